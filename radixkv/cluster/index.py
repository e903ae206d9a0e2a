"""The cluster-wide prefix index: per namespace, chained block hash -> the members holding it.

Pure data, no I/O: the router's followers (radixkv/cluster/follower.py) feed it from each
member's Events stream and DumpTree snapshots. A member's tree is prefix-closed (a cached block's
parent is cached), so the members holding block i of a prompt are a subset of those holding
block i - 1, and a member's cached prefix is found by one walk down the prompt's hashes:

    prompt blocks     h0      h1      h2      h3
    holders         {a,b,c} {a,b}   {a}     {}      -> a: 3 blocks, b: 2, c: 1, others 0

Hashes are the ones events carry (radixkv.events.chain_hashes: namespace salt, parent hash,
the block's tokens), so equal hashes mean equal namespace and prefix (up to 64-bit collisions);
the index is advisory anyway: the member's own Match decides what is reused.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence


class ClusterIndex:
    """Thread-safe: followers write, Route reads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders: dict[str, dict[int, set[str]]] = {}  # namespace -> hash -> members
        self._blocks: dict[str, dict[str, set[int]]] = {}  # member -> namespace -> hashes

    def stored(self, member: str, namespace: str, hashes: Iterable[int]) -> None:
        with self._lock:
            mine = self._blocks.setdefault(member, {}).setdefault(namespace, set())
            holders = self._holders.setdefault(namespace, {})
            for h in hashes:
                mine.add(h)
                holders.setdefault(h, set()).add(member)

    def removed(self, member: str, namespace: str, hashes: Iterable[int]) -> None:
        with self._lock:
            mine = self._blocks.get(member, {}).get(namespace)
            if mine is None:
                return
            for h in hashes:
                if h in mine:
                    mine.discard(h)
                    self._unhold(namespace, h, member)
            if not mine:
                del self._blocks[member][namespace]

    def cleared(self, member: str, namespace: str) -> None:
        with self._lock:
            for h in self._blocks.get(member, {}).pop(namespace, ()):
                self._unhold(namespace, h, member)

    def replace(self, member: str, blocks: dict[str, set[int]]) -> None:
        """Set everything `member` holds at once (a rebuild from DumpTree snapshots)."""
        with self._lock:
            self._drop(member)
            self._blocks[member] = {ns: set(hs) for ns, hs in blocks.items() if hs}
            for ns, hs in self._blocks[member].items():
                holders = self._holders.setdefault(ns, {})
                for h in hs:
                    holders.setdefault(h, set()).add(member)

    def drop(self, member: str) -> None:
        """Forget a member (it left, expired or restarted)."""
        with self._lock:
            self._drop(member)

    def _drop(self, member: str) -> None:
        for ns, hs in self._blocks.pop(member, {}).items():
            for h in hs:
                self._unhold(ns, h, member)

    def _unhold(self, namespace: str, h: int, member: str) -> None:
        holders = self._holders[namespace]
        s = holders.get(h)
        if s is not None:
            s.discard(member)
            if not s:
                del holders[h]
                if not holders:
                    del self._holders[namespace]

    def cached_blocks(self, namespace: str, hashes: Sequence[int],
                      members: Iterable[str]) -> dict[str, int]:
        """How many leading blocks of the prompt (its chained `hashes`) each of `members`
        holds."""
        out = dict.fromkeys(members, 0)
        with self._lock:
            holders = self._holders.get(namespace)
            if holders is None:
                return out
            alive = set(out)
            for i, h in enumerate(hashes):
                hold = holders.get(h)
                nxt = alive & hold if hold else set()
                for m in alive - nxt:
                    out[m] = i
                alive = nxt
                if not alive:
                    break
            for m in alive:
                out[m] = len(hashes)
        return out

    def knows(self, namespace: str) -> bool:
        with self._lock:
            return namespace in self._holders

    def member_blocks(self, member: str) -> dict[str, set[int]]:
        """A copy of what the index holds for `member` (namespace -> hashes)."""
        with self._lock:
            return {ns: set(hs) for ns, hs in self._blocks.get(member, {}).items()}

    def size(self, member: str) -> tuple[int, int]:
        """(blocks, namespaces) held for `member`."""
        with self._lock:
            mine = self._blocks.get(member, {})
            return sum(len(hs) for hs in mine.values()), len(mine)
