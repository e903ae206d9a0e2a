"""The prefix index of a sliding-window model: each cached block has two parts.

A block's *full part* holds the KV of the full-attention layers; its *window part* the KV of the
windowed layers (an all-windowed model has full parts of zero bytes: they only name positions).
Resuming a prompt at block depth d needs the full parts of blocks [0, d) and the window parts of
only the last min(d, window_blocks) of them, so window parts behind every resume point that
matters can be freed while the full parts stay:

    depth     0    1    2    3    4    5    6      window_blocks = 2
    full      F0   F1   F2   F3   F4   F5   F6     full parts: contiguous from the root
    window    --   --   W2   --   W4   W5   W6     "--": a hole (freed or never stored)
    resumable d = 0, 3 (W1? no: d = 3 needs W1, W2) ... d = 6 and d = 7 (W5 W6): match -> 7

Match returns the deepest d whose last min(d, window_blocks) window parts are all present (d = 0
always is). Full parts are only evicted as today (the policy's leaf, tail first, both parts go).
Window parts alone go in a second phase (`evict_windows`): unlocked ones outside every leaf's
tail window, least recently touched first and, on a path touched at once, root side first. A
leaf's last window_blocks window parts are protected until the leaf itself is trimmed: without
them the branch could never be resumed at its end.

Insert takes the window parts of the last len(window_ids) blocks of its tokens: a hole gets the
new part (the prefix becomes resumable again), a present part makes the new one a duplicate.
Each node knows the depth of the shallowest leaf below it (`min_leaf`), which says which of its
blocks lie in some leaf's tail window.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from radixkv.index.eviction import EvictionPolicy
from radixkv.index.node import Handle, Node
from radixkv.index.results import InsertResult, MatchResult, WindowRemoved, WindowStored
from radixkv.index.tree import RadixTree
from radixkv.protocol.errors import IntegrityError, InvalidArgument
from radixkv.protocol.limits import HOLE
from radixkv.protocol.tokens import TokensLike, to_token_bytes


@dataclass(frozen=True, slots=True)
class WindowMatch(MatchResult):
    """A windowed tree's match (a subclass: the full-attention path builds no more fields)."""

    window_ids: tuple[int, ...] = ()  # window parts of the last min(blocks, window_blocks)
    full_tokens: int = 0  # tokens whose full parts are cached (>= num_tokens)


class WindowNode(Node):
    __slots__ = ("window_ids", "min_leaf")

    def __init__(self, node_id: int, parent: Node | None, tokens: bytes,
                 block_ids: tuple[int, ...], depth: int, tick: int, now: float) -> None:
        super().__init__(node_id, parent, tokens, block_ids, depth, tick, now)
        self.window_ids = array("I", [HOLE]) * len(block_ids)
        self.min_leaf = depth  # depth of the shallowest leaf in this subtree (itself if a leaf)


class WindowedRadixTree(RadixTree):
    """RadixTree whose blocks also carry window parts; see the module docstring."""

    _node_type = WindowNode

    def __init__(self, block_size: int, window_blocks: int,
                 policy: str | EvictionPolicy[Any] = "lru", **kwargs: Any) -> None:
        if not isinstance(window_blocks, int) or window_blocks < 1:
            raise InvalidArgument(f"window_blocks must be a positive int, got {window_blocks!r}")
        super().__init__(block_size, policy, **kwargs)
        self.window_blocks = window_blocks
        self._windows: list[tuple[int, int, int, WindowNode]] = []  # (tick, start, id, node) heap
        self._num_windows = 0  # window parts held
        self._gone: list[tuple[int, int]] = []  # (full, window) parts evict() dropped
        self._wheld = bytearray()  # one byte per window part id: held by the tree

    @property
    def num_window_blocks(self) -> int:
        return self._num_windows

    # -- reads ------------------------------------------------------------------------------

    def match(self, tokens: TokensLike) -> WindowMatch:
        """The deepest resumable prefix of `tokens`: full parts of its blocks, and the window
        parts of its last min(depth, window_blocks) blocks."""
        key = to_token_bytes(tokens)
        node, k, ids = self._walk(key)
        path: list[WindowNode] = []
        n: Any = node
        while n is not self._root:
            path.append(n)
            n = n.parent
        path.reverse()
        windows = array("I")
        for n in path:
            windows += n.window_ids
        del windows[len(ids):]
        d = self._resumable(windows)
        if d < len(ids):  # cut back: find the node holding block d - 1
            node, k = self._root, 0
            for n in path:
                start = n.depth - len(n.block_ids)
                if start < d:
                    node, k = n, d - start
        handle = Handle(self, node, k if node is not self._root else 0, self._version)
        w = min(d, self.window_blocks)
        return WindowMatch(d * self._block_size, tuple(ids[:d]), handle,
                           tuple(windows[d - w:d]), len(ids) * self._block_size)

    def _resumable(self, windows: array[int]) -> int:
        """The deepest d <= len(windows) whose last min(d, window_blocks) parts are present."""
        run, best, wb = 0, 0, self.window_blocks
        for i, w in enumerate(windows):
            run = 0 if w == HOLE else run + 1
            if run >= min(i + 1, wb):
                best = i + 1
        return best

    # -- mutations --------------------------------------------------------------------------

    def insert(self, tokens: TokensLike, block_ids: Sequence[int],
               hint: str | int | None = None,
               window_ids: Sequence[int] = ()) -> InsertResult:
        """RadixTree.insert, plus `window_ids`: the window parts of the last len(window_ids)
        blocks of `tokens` (HOLE: none for that block). Adopted and duplicate ids of both parts
        are in the result."""
        key = to_token_bytes(tokens)
        nb = len(key) // self._block_bytes
        given, wins = list(block_ids), list(window_ids)
        if len(wins) > nb:
            raise InvalidArgument(f"got {len(wins)} window parts for {nb} full blocks")
        real = [w for w in wins if w != HOLE]
        if real:
            if len(set(real)) != len(real):
                raise InvalidArgument("a window part id is repeated")
            if min(real) < 0 or max(real) > HOLE:
                raise InvalidArgument(f"window part ids must be in 0..{HOLE - 1}")
            if set(real) & set(given):
                raise InvalidArgument("an id is given as both a full part and a window part")
            present = self._windows_along(key, nb)
            held, full = self._wheld, self._cached
            for i, w in enumerate(wins, nb - len(wins)):
                if w == HOLE:
                    continue
                if w < len(held) and held[w] and present[i] != w:
                    raise InvalidArgument(f"window part {w} (block {i}) is already cached "
                                          "elsewhere")
                if w < len(full) and full[w]:
                    raise InvalidArgument(f"window part {w} (block {i}) is cached as a full part")
        held = self._wheld
        for i, b in enumerate(given):
            if 0 <= b < len(held) and held[b]:
                raise InvalidArgument(f"block id {b} (block {i}) is cached as a window part")
        result = super().insert(key, given, hint)
        if result.adopted:  # a new leaf: its ancestors' shallowest leaf may change
            leaf: Any = self._walk(key)[0]
            self._refresh(leaf.parent)
        if not real:
            return result
        adopted, duplicates = list(result.adopted), list(result.duplicates)
        stored_full, stored_win = [], []
        if len(held) <= max(real):
            held.extend(bytes(max(max(real) + 1 - len(held), len(held))))
        first = nb - len(wins)
        for n, j, i in self._positions(key, first, nb):
            w = wins[i - first]
            have = n.window_ids[j]
            if w == HOLE or have == w:
                continue
            if have != HOLE:
                duplicates.append(w)
                continue
            n.window_ids[j] = w
            held[w] = 1
            adopted.append(w)
            stored_full.append(n.block_ids[j])
            stored_win.append(w)
            self._num_windows += 1
            self._queue(n)
        if stored_win and self._events is not None:
            self._events.append(WindowStored(tuple(stored_full), tuple(stored_win)))
        return InsertResult(tuple(adopted), tuple(duplicates), result.num_cached_tokens)

    def evict(self, num_blocks: int, max_leaves: int | None = None) -> list[int]:
        """RadixTree.evict (full parts, from the policy's leaves); the trimmed blocks' window
        parts go too and follow the full parts in the returned ids (the BlockRemoved event
        covers both parts)."""
        freed = super().evict(num_blocks, max_leaves)
        gone, self._gone = self._gone, []
        return freed + [w for _, w in gone]  # their BlockRemoved says both parts went

    def evict_windows(self, num_windows: int) -> list[int]:
        """Free up to `num_windows` window parts alone: unlocked, outside every leaf's tail
        window, least recently touched node first, root side first. Returns their ids."""
        if num_windows < 0:
            raise InvalidArgument(f"num_windows must be >= 0, got {num_windows}")
        freed_full: list[int] = []
        freed: list[int] = []
        skipped = []
        heap = self._windows
        while len(freed) < num_windows and heap:
            entry = heapq.heappop(heap)
            tick, _, _, n = entry
            if n.tick != tick:  # touched since queued: requeue at its current tick
                self._queue(n)
                continue
            if not n.block_ids or n.parent.children.get(n.tokens[:self._block_bytes]) is not n:
                continue  # evicted
            upto = self._unprotected(n)
            if upto <= 0:
                if any(w != HOLE for w in n.window_ids):
                    skipped.append(entry)
                continue
            ws = n.window_ids
            for j in range(upto):
                if ws[j] != HOLE and len(freed) < num_windows:
                    freed.append(ws[j])
                    freed_full.append(n.block_ids[j])
                    self._wheld[ws[j]] = 0
                    ws[j] = HOLE
            if any(w != HOLE for w in ws):
                skipped.append(entry)
        for entry in skipped:
            heapq.heappush(heap, entry)
        if freed:
            self._num_windows -= len(freed)
            self._version += 1  # a handle's resumable depth may have changed
            if self._events is not None:
                self._events.append(WindowRemoved(tuple(freed_full), tuple(freed)))
        return freed

    @property
    def num_evictable_windows(self) -> int:
        """Window parts evict_windows() could free now (a scan: for stats, not the hot path)."""
        total, stack = 0, list(self._root.children.values())
        while stack:
            n: Any = stack.pop()
            stack.extend(n.children.values())
            total += sum(1 for w in n.window_ids[:max(0, self._unprotected(n))] if w != HOLE)
        return total

    def _unprotected(self, n: Any) -> int:
        """How many of node n's blocks, from its first, may lose their window parts: none
        while it is locked; else those before the last window_blocks blocks of its shallowest
        leaf (every leaf's tail window stays resumable)."""
        if n.lock_count:
            return 0
        return int(min(len(n.block_ids), n.min_leaf - self.window_blocks
                       - (n.depth - len(n.block_ids))))

    # -- internals --------------------------------------------------------------------------

    def window_parts(self, tokens: TokensLike) -> list[int]:
        """The window part cached at each full block of `tokens` (HOLE where none)."""
        key = to_token_bytes(tokens)
        return self._windows_along(key, len(key) // self._block_bytes)

    def _windows_along(self, key: bytes, nb: int) -> list[int]:
        out = [HOLE] * nb
        for n, j, i in self._positions(key, 0, nb):
            out[i] = n.window_ids[j]
        return out

    def _positions(self, key: bytes, first: int, end: int) -> list[tuple[WindowNode, int, int]]:
        """(node, index in its edge, block index) of the cached blocks first..end-1 of key."""
        out: list[tuple[WindowNode, int, int]] = []
        node: Any = self._root
        bb, pos, i = self._block_bytes, 0, 0
        while i < end:
            child = node.children.get(key[pos:pos + bb])
            if child is None:
                break
            for j in range(len(child.block_ids)):
                if i >= end or key[pos:pos + bb] != child.tokens[j * bb:(j + 1) * bb]:
                    return out
                if i >= first:
                    out.append((child, j, i))
                pos, i = pos + bb, i + 1
            node = child
        return out

    def _queue(self, n: WindowNode) -> None:
        heapq.heappush(self._windows, (n.tick, n.depth - len(n.block_ids), n.node_id, n))
        if len(self._windows) > 4 * self._num_nodes + 1024:  # drop stale entries
            live = {id(n): n for *_, n in self._windows if n.block_ids
                    and any(w != HOLE for w in n.window_ids)}
            self._windows = [(n.tick, n.depth - len(n.block_ids), n.node_id, n)
                             for n in live.values()]
            heapq.heapify(self._windows)

    def _trimming(self, node: Node, keep: int) -> None:
        n: Any = node
        ws = n.window_ids
        gone = [(n.block_ids[j], ws[j]) for j in range(len(ws) - 1, keep - 1, -1)
                if ws[j] != HOLE]
        for _, w in gone:
            self._wheld[w] = 0
        self._num_windows -= len(gone)
        self._gone += gone
        del ws[keep:]
        if keep:
            n.min_leaf = n.depth - (len(n.block_ids) - keep)
            self._refresh(n.parent)
        else:
            parent = n.parent
            # the node leaves its parent after this hook: recompute without it
            self._refresh(parent, without=n)

    def _refresh(self, node: Any, without: Any = None) -> None:
        """Recompute min_leaf from `node` up while it changes."""
        while node is not self._root:
            kids = [c.min_leaf for c in node.children.values() if c is not without]
            value = min(kids) if kids else node.depth
            if value == node.min_leaf:
                return
            node.min_leaf, without = value, None
            node = node.parent

    def _split(self, node: Node, k: int) -> Node:
        n: Any = node
        front: Any = super()._split(node, k)
        front.window_ids, n.window_ids = n.window_ids[:k], n.window_ids[k:]
        front.min_leaf = n.min_leaf
        if any(w != HOLE for w in front.window_ids):
            self._queue(front)
        return front  # type: ignore[no-any-return]

    def check_integrity(self) -> None:
        super().check_integrity()

        def fail(msg: str) -> None:
            raise IntegrityError(msg)

        queued = {n.node_id for *_, n in self._windows}
        count, stack = 0, list(self._root.children.values())
        full: set[int] = set()
        windows: set[int] = set()
        while stack:
            n: Any = stack.pop()
            stack.extend(n.children.values())
            full.update(n.block_ids)
            if len(n.window_ids) != len(n.block_ids):
                fail(f"node {n.node_id}: {len(n.window_ids)} window slots for "
                     f"{len(n.block_ids)} blocks")
            want = min((c.min_leaf for c in n.children.values()), default=n.depth)
            if n.min_leaf != want:
                fail(f"node {n.node_id}: min_leaf {n.min_leaf} != {want}")
            live = [w for w in n.window_ids if w != HOLE]
            count += len(live)
            for w in live:
                if w in windows or not self._wheld[w]:
                    fail(f"window part {w}: repeated or not marked held")
                windows.add(w)
            if live and n.node_id not in queued:
                fail(f"node {n.node_id} holds window parts but is not queued for eviction")
        if full & windows:
            fail(f"ids {sorted(full & windows)[:4]} are both full and window parts")
        if count != self._num_windows or self._wheld.count(1) != count:
            fail(f"{count} window parts in the tree, counted {self._num_windows}, "
                 f"{self._wheld.count(1)} marked held")
