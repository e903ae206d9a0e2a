"""The cluster-wide prefix index: per namespace, chained block hash -> the members holding it.

Pure data, no I/O: the router's followers (radixkv/cluster/follower.py) feed it from each
member's Events stream and DumpTree snapshots. A member's tree is prefix-closed (a cached block's
parent is cached), so the members holding block i of a prompt are a subset of those holding
block i - 1, and a member's cached prefix is found by one walk down the prompt's hashes:

    prompt blocks     h0      h1      h2      h3
    holders         {a,b,c} {a,b}   {a}     {}      -> a: 3 blocks, b: 2, c: 1, others 0

Sliding-window members resume a prefix of d blocks only while the window parts of its last
min(d, window_blocks) blocks are held (radixkv/index/window_tree.py): the index also keeps, per
such member, the hashes of the blocks whose window part is held (WindowStored/WindowRemoved
events, DumpTree's window_ids), and a member's answer is the deepest such d within its cached
prefix:

    prompt blocks     h0  h1  h2  h3  h4      window_blocks = 2
    held (full)       x   x   x   x   x
    window parts      -   x   -   x   x       -> resumable at d = 2 (h0 h1) and 5 (h3 h4): 5

Hashes are the ones events carry (radixkv.protocol.block_hashes.chain_hashes: namespace salt,
parent hash, the block's tokens), so equal hashes mean equal namespace and prefix (up to 64-bit
collisions); the index is advisory anyway: the member's own Match decides what is reused.
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
        # sliding-window members: member -> namespace -> hashes whose window part is held
        self._windows: dict[str, dict[str, set[int]]] = {}
        self._window_blocks: dict[str, int] = {}  # member -> its window_blocks (0: none)

    def stored(self, member: str, namespace: str, hashes: Iterable[int]) -> None:
        with self._lock:
            mine = self._blocks.setdefault(member, {}).setdefault(namespace, set())
            holders = self._holders.setdefault(namespace, {})
            for h in hashes:
                mine.add(h)
                holders.setdefault(h, set()).add(member)

    def window_stored(self, member: str, namespace: str, hashes: Iterable[int]) -> None:
        with self._lock:
            self._windows.setdefault(member, {}).setdefault(namespace, set()).update(hashes)

    def window_removed(self, member: str, namespace: str, hashes: Iterable[int]) -> None:
        with self._lock:
            self._window_gone(member, namespace, hashes)

    def _window_gone(self, member: str, namespace: str, hashes: Iterable[int]) -> None:
        held = self._windows.get(member, {}).get(namespace)
        if held is not None:
            held.difference_update(hashes)
            if not held:
                del self._windows[member][namespace]

    def removed(self, member: str, namespace: str, hashes: Iterable[int]) -> None:
        with self._lock:
            hashes = list(hashes)
            self._window_gone(member, namespace, hashes)
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
            self._windows.get(member, {}).pop(namespace, None)
            for h in self._blocks.get(member, {}).pop(namespace, ()):
                self._unhold(namespace, h, member)

    def replace(self, member: str, blocks: dict[str, set[int]],
                windows: dict[str, set[int]] | None = None, window_blocks: int = 0) -> None:
        """Set everything `member` holds at once (a rebuild from DumpTree snapshots).
        `window_blocks` > 0: a sliding-window member, `windows` the hashes of its blocks whose
        window part it holds."""
        with self._lock:
            self._drop(member)
            if window_blocks:
                self._window_blocks[member] = window_blocks
                self._windows[member] = {ns: set(hs) for ns, hs in (windows or {}).items() if hs}
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
        self._windows.pop(member, None)
        self._window_blocks.pop(member, None)
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
            for m, depth in out.items():
                wb = self._window_blocks.get(m)
                if wb and depth:
                    out[m] = self._resumable(hashes[:depth], wb,
                                             self._windows.get(m, {}).get(namespace, set()))
        return out

    @staticmethod
    def _resumable(hashes: Sequence[int], window_blocks: int, held: set[int]) -> int:
        """The deepest d <= len(hashes) whose last min(d, window_blocks) blocks have their
        window parts held (as the member's own Match computes it)."""
        run = best = 0
        for i, h in enumerate(hashes):
            run = run + 1 if h in held else 0
            if run >= min(i + 1, window_blocks):
                best = i + 1
        return best

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
