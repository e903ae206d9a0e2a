"""The two kinds of namespace, behind one contract: full attention and sliding window.

A namespace is one radix tree of token prefixes, its lifetime counters and its live lease
count. What differs between a full-attention pool and a sliding-window one (on windowed pools
each block has a full part and a window part that only the last window_blocks blocks of a
resume need) lives here, in `Namespace` and its subclass `WindowNamespace`, as the index has
`RadixTree` and `WindowedRadixTree`: match, answer, plan_store, stored, check_claims, insert,
evict, evicted, evict_windows, end_lease, stats, nodes, span, blocks_to_store (each method's
docstring says what it does). A kind's Match answer is a value (LeaseMatch, or
WindowLeaseMatch with its window parts) that radixkv.protocol.wire encodes; no kind knows the
wire. The service picks the kind once, from the pool's layout (`kind_of`), and never asks
which one it has. A third kind, key-keyed (radixkv.service.keyed), names blocks by opaque keys
instead of tokens: `Namespaces.open` makes one where a call gives keys.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from radixkv.index.eviction import EvictionPolicy
from radixkv.index.hints import NO_HINT
from radixkv.index.results import BlockRemoved, InsertResult, MatchResult, NodeView, TreeEvent
from radixkv.index.tree import RadixTree
from radixkv.index.window_tree import WindowedRadixTree, WindowMatch
from radixkv.protocol.errors import FailedPrecondition
from radixkv.protocol.limits import HOLE
from radixkv.protocol.tokens import block_bytes, num_tokens
from radixkv.protocol.values import LeaseMatch, NamespaceStats, WindowLeaseMatch
from radixkv.service.leases import Lease


@dataclass(slots=True)
class Counters:
    """Lifetime request counters (of a namespace, or of the namespaces already dropped)."""

    requests: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    evicted_blocks: int = 0

    def add(self, other: Counters) -> None:
        self.requests += other.requests
        self.query_tokens += other.query_tokens
        self.hit_tokens += other.hit_tokens
        self.evicted_blocks += other.evicted_blocks


class Namespace:
    """A full-attention namespace."""

    key_size = 0  # token-keyed (radixkv.service.keyed: key-keyed)
    tiered = True  # its blocks may go to the tier below the pool (docs/disk-tier.md)

    def __init__(self, name: str, block_size: int, window_blocks: int, policy: EvictionPolicy[Any],
                 clock: Callable[[], int]) -> None:
        self.name = name
        self.block_size = block_size
        self.tree = self._new_tree(block_size, window_blocks, policy, clock)
        self.num_leases = 0  # live leases in this namespace
        self.life = Counters()

    @staticmethod
    def _new_tree(block_size: int, window_blocks: int, policy: EvictionPolicy[Any],
                  clock: Callable[[], int]) -> RadixTree:
        return RadixTree(block_size, policy, clock=clock)

    # ---- match -------------------------------------------------------------------------------

    def span(self, tokens: bytes) -> int:
        """The tokens a query's data stands for."""
        return num_tokens(tokens)

    def blocks_to_store(self, tokens: bytes, store_tokens: int) -> int:
        """The full blocks among the first `store_tokens` tokens of the query."""
        return min(store_tokens, num_tokens(tokens)) // self.block_size

    def match(self, lease: Lease, tokens: bytes) -> MatchResult:
        """The tree's match of `tokens`, pinned for `lease` and counted as a request."""
        m = self.tree.match(tokens)
        if m.num_tokens:
            self.tree.lock(m.handle)
            self._pin(lease, m.handle)
        self.life.requests += 1
        self.life.query_tokens += num_tokens(tokens)
        self.life.hit_tokens += m.num_tokens
        return m

    def answer(self, lease_id: int, m: MatchResult, epoch: str) -> LeaseMatch:
        """The Match answer of the tree's match `m`."""
        return LeaseMatch(lease_id, m.num_tokens, m.block_ids, epoch)

    # ---- plan a store ------------------------------------------------------------------------

    def plan_store(self, o: LeaseMatch, tokens: bytes, end: int, m: MatchResult) -> list[int]:
        """Which of blocks [len(o.block_ids), end) get window parts when a Match stores them
        (`m`: the tree's match behind `o`)."""
        return []

    def stored(self, o: LeaseMatch, ids: tuple[int, ...], wids: tuple[int, ...],
               need: list[int], end: int, num_evicted: int) -> LeaseMatch:
        """`o` with the blocks (`ids`) and window parts (`wids`, one per `need`) allocated for
        its stored range, which ends at block `end`."""
        return LeaseMatch(o.lease_id, o.num_tokens, o.block_ids, o.epoch, ids, num_evicted)

    # ---- check claims, insert ----------------------------------------------------------------

    def check_claims(self, lease: Lease, tokens: bytes, block_ids: Sequence[int],
                     window_ids: Sequence[int], claimed: set[int]) -> list[tuple[int, str]]:
        """Each id must be the lease's own (not claimed by an earlier item of the batch) or the
        id the tree already caches at that position. The common case (all are) is claimed
        here; else the ids not cached at their position, in order, with what each is ("block",
        "window part"), for the lease table to claim one by one (LeaseTable.claim)."""
        cached = self.tree.match(tokens).block_ids
        rest = block_ids[len(cached):]
        if (tuple(block_ids[:len(cached)]) == cached and claimed.isdisjoint(rest)
                and lease.owned.keys() >= set(rest)):  # the common case, in C
            claimed.update(rest)
            return []
        return [(b, "block") for i, b in enumerate(block_ids)
                if not (i < len(cached) and cached[i] == b)]

    def insert(self, lease: Lease, tokens: bytes, block_ids: Sequence[int], hint: int,
               window_ids: Sequence[int], pin: bool) -> InsertResult:
        """Insert what check_claims passed: the adopted and duplicate ids are no longer the
        lease's (the caller frees the duplicates); with `pin`, the lease pins what was
        inserted for the rest of its life (the engine may still read it)."""
        result = self._tree_insert(tokens, block_ids, hint, window_ids)
        deque(map(lease.owned.pop, result.adopted + result.duplicates), 0)
        if pin and (handle := self.tree.lock_inserted()) is not None:
            self._pin(lease, handle)
        return result

    def _pin(self, lease: Lease, handle: object) -> None:
        """Keep a locked handle among the lease's pins, one per path: a path that a pin of the
        lease already holds is unlocked again (a pin ending there moves last: the deepest the
        lease pinned lately, for the release hint), and a pin that this path holds (one at
        most: no pinned path holds another) is unlocked and replaced by it. So the lease's
        pins are its distinct deepest paths, and repeated Inserts never grow them. O(depth),
        and a scan of the lease's pins only for a path that others pin too, once per path."""
        tree, pins = self.tree, lease.handles
        path = tree.path_of(handle)
        end = path[0]
        held = pins.pop(end, None)
        if held is None and end not in lease.covered and tree.lock_count(handle) > 1 and any(
                tree.covers(h, handle) for h in pins.values()):
            lease.covered.add(end)  # held by a deeper pin (pins only ever get deeper)
        if held is not None or end in lease.covered:
            tree.unlock(handle)
            if held is not None:
                pins[end] = held
            return
        for node in path[1:]:
            if (shallower := pins.pop(node, None)) is not None:
                tree.unlock(shallower)
                break
        pins[end] = handle

    def _tree_insert(self, tokens: bytes, block_ids: Sequence[int], hint: int,
                     window_ids: Sequence[int]) -> InsertResult:
        return self.tree.insert(tokens, block_ids, hint)

    def end_lease(self, lease: Lease, hint: int) -> None:
        """Drop a lease's pins; `hint` (if any) goes to the deepest path it pinned (the last)."""
        handles = list(lease.handles.values())
        if hint != NO_HINT and handles:
            self.tree.hint(handles[-1], hint)
        for handle in handles:
            self.tree.unlock(handle)
        self.num_leases -= 1

    # ---- evict, count ------------------------------------------------------------------------

    def evict(self, num_blocks: int, max_leaves: int | None = None) -> list[int]:
        """Pool ids freed by evicting up to `num_blocks` blocks' worth of leaf tails."""
        return self.tree.evict(num_blocks, max_leaves)

    def evicted(self, freed: list[int]) -> tuple[list[TreeEvent], int]:
        """After `evict` returned `freed`: the events to publish, and how many blocks went (one
        BlockRemoved per run of evictions, in eviction order)."""
        self.tree.take_events()
        return [BlockRemoved(tuple(freed))], len(freed)

    def evict_windows(self, num_windows: int) -> list[int]:
        """Window parts freed alone (up to `num_windows`)."""
        return []

    def evict_all(self) -> list[int]:
        """Every cached id, evicted without events (the caller publishes AllBlocksCleared);
        FailedPrecondition while a lease (or a promotion from the disk tier) pins or holds
        anything here."""
        if self.num_leases:
            raise FailedPrecondition(
                f"namespace {self.name!r} has {self.num_leases} live lease(s) "
                f"({self.tree.num_locked_blocks} blocks pinned); release them first")
        if self.tree.num_locked_blocks:  # pinned without a lease: a promotion from disk
            raise FailedPrecondition(f"namespace {self.name!r} has blocks coming up from the "
                                     "disk tier; try again")
        freed = self.tree.evict(self.tree.num_cached_blocks)
        self.tree.take_events()
        return freed

    @property
    def num_window_blocks(self) -> int:
        return 0

    def stats(self) -> NamespaceStats:
        return NamespaceStats(self.name, self.tree.num_cached_blocks, self.tree.stats().num_nodes,
                              self.life.requests, self.life.query_tokens, self.life.hit_tokens,
                              self.life.evicted_blocks)

    def shown(self, nodes: list[NodeView]) -> list[NodeView]:
        """Tree nodes as this kind shows them (key-keyed: keys, not tokens)."""
        return nodes

    @property
    def cursor_unit(self) -> tuple[int, str]:
        """What a tree-dump cursor is a path of: bytes per tree block, and their name."""
        return block_bytes(self.block_size), f"{self.block_size}-token blocks"

    def nodes(self, max_depth: int = 0) -> list[NodeView]:
        """The tree's nodes, DFS pre-order, at most `max_depth` edges deep when > 0."""
        nodes = list(self.tree.nodes())
        if not max_depth:
            return nodes
        depth: dict[int | None, int] = {None: 0}
        kept = []
        for node in nodes:
            depth[node.node_id] = depth[node.parent_id] + 1
            if depth[node.node_id] <= max_depth:
                kept.append(node)
        return kept


class WindowNamespace(Namespace):
    """A sliding-window namespace: blocks have a full part and maybe a window part; a resume
    needs the window parts of its last window_blocks blocks."""

    tiered = False  # the disk tier holds full-attention blocks only (docs/disk-tier.md)

    def __init__(self, name: str, block_size: int, window_blocks: int, policy: EvictionPolicy[Any],
                 clock: Callable[[], int]) -> None:
        super().__init__(name, block_size, window_blocks, policy, clock)
        self.window_blocks = window_blocks
        tree = self.tree
        assert isinstance(tree, WindowedRadixTree)
        self.wtree = tree  # the same tree, typed as what it is

    @staticmethod
    def _new_tree(block_size: int, window_blocks: int, policy: EvictionPolicy[Any],
                  clock: Callable[[], int]) -> RadixTree:
        return WindowedRadixTree(block_size, window_blocks, policy, clock=clock)

    def answer(self, lease_id: int, m: MatchResult, epoch: str) -> LeaseMatch:
        assert isinstance(m, WindowMatch)
        return WindowLeaseMatch(lease_id, m.num_tokens, m.block_ids, epoch,
                                window_ids=m.window_ids)

    def plan_store(self, o: LeaseMatch, tokens: bytes, end: int, m: MatchResult) -> list[int]:
        """A request resumed at d stores the window parts of its last window_blocks blocks,
        and, where the cached full parts reach further than the match (to full_end: a branch
        point), of the window_blocks before full_end that lack theirs."""
        assert isinstance(m, WindowMatch)
        full_end = m.full_tokens // self.block_size
        d, wb = len(o.block_ids), self.window_blocks
        need = set(range(max(d, end - wb), end))
        branch = min(full_end, end)
        if branch > d:
            need.update(range(max(d, branch - wb), branch))
            have = self.wtree.window_parts(tokens)
            need = {i for i in need if i >= full_end or have[i] == HOLE}
        return sorted(need)

    def stored(self, o: LeaseMatch, ids: tuple[int, ...], wids: tuple[int, ...],
               need: list[int], end: int, num_evicted: int) -> LeaseMatch:
        """New window parts aligned to the stored range's last blocks, HOLE where none."""
        if need:
            aligned = [HOLE] * (end - need[0])
            for i, w in zip(need, wids, strict=True):
                aligned[i - need[0]] = w
            wids = tuple(aligned)
        assert isinstance(o, WindowLeaseMatch)
        return dataclasses.replace(o, new_block_ids=ids, num_evicted=num_evicted,
                                   new_window_ids=wids)

    def check_claims(self, lease: Lease, tokens: bytes, block_ids: Sequence[int],
                     window_ids: Sequence[int], claimed: set[int]) -> list[tuple[int, str]]:
        """The full parts as on full attention; then each window part must be the lease's own
        (unclaimed) or the one cached at its block."""
        out = super().check_claims(lease, tokens, block_ids, window_ids, claimed)
        if not window_ids:
            return out
        cached = self.wtree.window_parts(tokens)
        first = len(cached) - len(window_ids)
        return out + [(w, "window part") for i, w in enumerate(window_ids, first)
                      if w != HOLE and cached[i] != w]

    def _tree_insert(self, tokens: bytes, block_ids: Sequence[int], hint: int,
                     window_ids: Sequence[int]) -> InsertResult:
        return self.wtree.insert(tokens, block_ids, hint, window_ids=window_ids)

    def evicted(self, freed: list[int]) -> tuple[list[TreeEvent], int]:
        """`freed` holds full and window parts: the tree's own events say which were full."""
        events = self.tree.take_events()
        return events, sum(len(ev.block_ids) for ev in events if isinstance(ev, BlockRemoved))

    def evict_windows(self, num_windows: int) -> list[int]:
        return self.wtree.evict_windows(num_windows)

    @property
    def num_window_blocks(self) -> int:
        return self.wtree.num_window_blocks


def kind_of(window_blocks: int) -> type[Namespace]:
    """The namespace kind of a pool whose layout has `window_blocks` (0: full attention)."""
    return WindowNamespace if window_blocks else Namespace

