"""The prefix index: a radix tree from whole token blocks to pool block ids.

Edges hold whole blocks (block_size tokens, 4 bytes per token); a node's children are keyed by
the bytes of their first block, and token runs are compared with bytes operations (in C):

    root ──[A B C]──▶ n1 ──[D]────▶ n2        tokens A B C D   -> blocks 7 8 9 4
      │                └──[E F]──▶ n3        tokens A B C E F -> blocks 7 8 9 5 6
      └───[G]──────▶ n4

A trailing partial block is never cached. Every node has a lock count (path-wide: a lock pins a
node and all its ancestors), a hit count, and a logical tick of its last touch; a touch stamps
the whole path with one tick, so a parent's tick is never older than its children's. Eviction
trims blocks from the tail of the unlocked leaf that the policy picks (LRU: oldest tick), which
is exactly per-block leaf eviction in a tree of 1-block nodes. A node also counts the requests
whose prompt ended at its end (`ends`, for the adaptive policy's lineage) and carries the
client's retention hint (`session_end`, `keep`) until its next hit. Nothing here does I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from radixkv.index.eviction import EvictionPolicy
from radixkv.index.handles import HandleCalls
from radixkv.index.hints import NO_HINT, parse_hint
from radixkv.index.integrity import Counters, check_block_ids, check_tree
from radixkv.index.node import DepthCounts, Handle, Node, add_child, drop_child
from radixkv.index.pages import view
from radixkv.index.policies import make_policy
from radixkv.index.results import (
    BlockRemoved,
    BlockStored,
    InsertResult,
    MatchResult,
    NodeView,
    TreeEvent,
    TreeStats,
    new_match_result,
)
from radixkv.protocol.errors import InvalidArgument
from radixkv.protocol.tokens import TokensLike, block_bytes, to_token_bytes


class RadixTree(HandleCalls):
    """Prefix index over whole blocks. Not thread-safe: callers serialize access."""

    _node_type: type[Node] = Node

    def __init__(
        self,
        block_size: int,
        policy: str | EvictionPolicy[Any] = "lru",
        *,
        record_events: bool = True,
        clock: Callable[[], int] | None = None,
    ) -> None:
        """`clock` gives the logical ticks that order touches; trees that share one (a service
        with several namespaces) can compare their victims with `next_victim_key()`. `policy`:
        a name (a bare tree defaults to "lru"; the service and the tools default to
        eviction.DEFAULT_POLICY, sized to their pool) or a new policy instance."""
        if not isinstance(block_size, int) or block_size <= 0:
            raise InvalidArgument(f"block_size must be a positive int, got {block_size!r}")
        self._block_size = block_size
        self._block_bytes = block_bytes(block_size)
        self._policy: EvictionPolicy[Node] = (make_policy(policy) if isinstance(policy, str)
                                              else policy)
        if len(self._policy):
            raise InvalidArgument("the eviction policy must start empty")
        self._root = self._node_type(0, None, b"", (), 0, 0, time.time())
        self._next_id = 1
        self._tick = 0
        self._clock = clock
        self._version = 0  # bumped by every structural change; fresh handles must match it
        # Which block ids the tree holds: one byte per id up to the largest seen (ids are pool
        # indices), far smaller than a dict from id to node.
        self._cached = bytearray()
        self._num_cached = 0
        self._num_nodes = self._num_locked = self._num_evicted = self._num_inserted = 0
        self._depths = DepthCounts()
        self._inserted = (self._root, -1)  # where the last insert ended, at which version
        self._events: list[TreeEvent] | None = [] if record_events else None

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_cached_blocks(self) -> int:
        return self._num_cached

    @property
    def num_locked_blocks(self) -> int:
        return self._num_locked

    @property
    def num_evictable_blocks(self) -> int:
        return self._num_cached - self._num_locked

    def next_victim_key(self) -> tuple[Any, ...] | None:
        """The policy's sort key of the leaf evict() would trim next (None if nothing is
        evictable). Comparable across trees that share a clock."""
        return self._policy.peek_key()

    # -- reads ------------------------------------------------------------------------------

    def match(self, tokens: TokensLike) -> MatchResult:
        """Longest cached prefix of `tokens` in whole blocks. Read-only: changes no structure,
        order or counter. The handle may be locked only before the next mutating call."""
        node, num_blocks, block_ids = self._walk(to_token_bytes(tokens))
        return new_match_result(len(block_ids) * self._block_size, block_ids,
                                Handle(self, node, num_blocks, self._version))

    def stats(self) -> TreeStats:
        return TreeStats(self._num_nodes, self.num_cached_blocks, self._num_locked,
                         self.num_evictable_blocks, self._num_evicted, self._num_inserted,
                         self._depths.max_depth)

    @property
    def root(self) -> Node:
        """The root node (no tokens, no blocks): for readers of the structure (index/pages.py)."""
        return self._root

    def nodes(self) -> Iterator[NodeView]:
        """A snapshot of every node but the root, depth-first pre-order (children in insertion
        order; index/pages.py reads the tree in pages, in path order)."""
        views, stack = [], list(reversed(self._root.children.values()))
        while stack:
            n = stack.pop()
            views.append(view(n, self._root, self._block_size))
            stack.extend(reversed(n.children.values()))
        return iter(views)

    def take_events(self) -> list[TreeEvent]:
        """Drain the BlockStored / BlockRemoved events queued by mutations, oldest first."""
        if self._events is None:
            return []
        events, self._events = self._events, []
        return events

    # -- mutations --------------------------------------------------------------------------

    def lock(self, handle: object, *, hit: bool = True) -> None:
        """Pin exactly the matched blocks: +1 lock count on every node of the path (splitting the
        last edge first if the match ends inside it), touch the path and count a hit on each node
        (hit=False: a pin that is not a cache hit, e.g. of blocks just inserted). A handle may
        be locked several times; each lock() needs its own unlock(). A handle that
        is not locked must be fresh (no insert, evict or splitting lock since its match);
        InvalidArgument otherwise. Locking an empty match is a no-op."""
        h = self._check_handle(handle)
        node = h.node
        if node is self._root:
            return
        if h.num_locks == 0:
            if h.version != self._version:
                raise InvalidArgument("stale match handle: the tree changed since match()")
            if h.num_blocks < len(node.block_ids):
                node = h.node = self._split(node, h.num_blocks)
        tick, now = self._next_tick(), time.time()
        while node is not self._root:
            if node.lock_count == 0:
                self._num_locked += len(node.block_ids)
                if not node.children:
                    self._policy.remove(node)
            node.lock_count += 1
            if hit:
                node.hits += 1
                node.hint = NO_HINT
            node.tick, node.last_access = tick, now
            node = node.parent
        h.num_locks += 1

    def unlock(self, handle: object) -> None:
        """Undo one lock() of this handle; InvalidArgument if it holds none. Does not touch.
        Unlocking an empty match is a no-op."""
        h = self._check_handle(handle)
        node = h.node
        if node is self._root:
            return
        if h.num_locks == 0:
            raise InvalidArgument("unlock() without a matching lock() of this handle")
        h.num_locks -= 1
        while node is not self._root:
            node.lock_count -= 1
            assert node.lock_count >= 0, f"node {node.node_id} lock count below zero"
            if node.lock_count == 0:
                self._num_locked -= len(node.block_ids)
                if not node.children:
                    self._policy.add(node)
            node = node.parent

    def insert(self, tokens: TokensLike, block_ids: Sequence[int],
               hint: str | int | None = None) -> InsertResult:
        """Cache the full blocks of `tokens`; block_ids[i] holds block i. For the prefix that is
        already cached, an id equal to the cached one is skipped and a different one is returned
        in `duplicates`; the rest are adopted as a new leaf. Touches the whole path, counts the
        request's end on the node where it ends, and gives that node `hint` (see `hint`).
        InvalidArgument (tree unchanged) for a count mismatch, a negative or repeated id, an id
        cached at another position, or an unknown hint."""
        code = NO_HINT if hint is None else parse_hint(hint)
        key, bb = to_token_bytes(tokens), self._block_bytes
        num_blocks, given = len(key) // bb, tuple(block_ids)
        top = check_block_ids(given, num_blocks, len(key), self._block_size)
        if not given:
            self._inserted = (self._root, self._version)
            return InsertResult((), (), 0)
        node, k, cached = self._walk(key)
        m, held = len(cached), self._cached
        if len(held) <= top:  # grow the bitmap geometrically
            held.extend(bytes(max(top + 1 - len(held), len(held))))
        duplicates = []
        if given[:m] != cached:
            duplicates = [g for g, c in zip(given, cached, strict=False) if g != c]
        new = given[m:]
        for b in (*duplicates, *new) if duplicates else new:
            if held[b]:
                i = next(i for i, g in enumerate(given) if held[g] and (i >= m or g != cached[i]))
                raise InvalidArgument(
                    f"block id {given[i]} (block {i}) is already cached elsewhere")

        if k < len(node.block_ids):
            node = self._split(node, k)
        tick, now = self._next_tick(), time.time()
        deepest, lineage = node, 0
        while node is not self._root:  # touch the path; count the earlier requests on it
            node.tick, node.last_access = tick, now
            lineage += node.ends > 0
            node = node.parent
        node = deepest
        if new:
            if not node.children and node is not self._root and node.lock_count == 0:
                self._policy.remove(node)  # stops being a leaf
            leaf = self._node_type(self._next_id, node, key[m * bb : num_blocks * bb],
                                   new, node.depth + len(new), tick, now)
            self._next_id += 1
            add_child(node, key[m * bb : (m + 1) * bb], leaf)
            for b in new:
                held[b] = 1
            self._num_cached += len(new)
            if self._policy.learns:
                self._policy.admit(leaf, lineage)
            self._policy.add(leaf)
            self._num_nodes += 1
            self._num_inserted += len(new)
            self._depths.add(leaf.depth)
            self._version += 1
            if self._events is not None:
                parent_block = node.block_ids[-1] if node is not self._root else None
                self._events.append(BlockStored(new, parent_block, leaf.tokens))
            deepest = leaf
        elif deepest is not self._root:
            self._policy.touch(deepest)
        if deepest is not self._root:
            deepest.ends += 1
            if code:
                self._give_hint(deepest, code)
        self._inserted = (deepest, self._version)
        return InsertResult(new, tuple(duplicates), m * self._block_size)

    def evict(self, num_blocks: int, max_leaves: int | None = None) -> list[int]:
        """Free up to `num_blocks` unlocked blocks, tail-first from the leaf the policy picks; a
        node left without blocks goes, and its parent may become a leaf. Returns the freed ids in
        eviction order (fewer when not enough are unlocked). `max_leaves`: trim at most that
        many leaves (one: only the victim `next_victim_key` describes, whose blocks share its
        key)."""
        if num_blocks < 0:
            raise InvalidArgument(f"num_blocks must be >= 0, got {num_blocks}")
        freed: list[int] = []
        policy, held, bb = self._policy, self._cached, self._block_bytes
        leaves = -1 if max_leaves is None else max_leaves  # -1: no limit
        while len(freed) < num_blocks and len(policy) and leaves:
            leaves -= 1
            node = policy.pop()
            keep = max(0, len(node.block_ids) - (num_blocks - len(freed)))
            if policy.learns:
                policy.evicted(node, keep)
            self._trimming(node, keep)
            gone = node.block_ids[keep:][::-1]  # tail-first
            freed += gone
            for b in gone:
                held[b] = 0
            self._num_cached -= len(gone)
            self._depths.drop(node.depth)
            if keep:
                node.block_ids = node.block_ids[:keep]
                node.tokens = node.tokens[: keep * bb]
                node.depth -= len(gone)
                self._depths.add(node.depth)
                policy.add(node)  # same key: still the first victim
            else:
                parent = node.parent
                drop_child(parent, node.tokens[:bb])
                self._num_nodes -= 1
                if not parent.children and parent is not self._root and parent.lock_count == 0:
                    policy.add(parent)
        if freed:
            self._num_evicted += len(freed)
            self._version += 1
            if self._events is not None:
                self._events.append(BlockRemoved(tuple(freed)))
        return freed

    # -- internals --------------------------------------------------------------------------

    def _trimming(self, node: Node, keep: int) -> None:
        """evict() is about to drop node's blocks [keep:] (the node itself when keep is 0).
        A hook for trees whose blocks hold more than one part; nothing here."""

    def _walk(self, key: bytes) -> tuple[Node, int, tuple[int, ...]]:
        """Follow `key` in whole blocks: (deepest node reached, blocks of its edge matched,
        matched block ids). The second is < the edge's blocks when the match ends inside it.
        The ids are the edges' tuples joined as the walk goes (a match that ends on the first
        edge hands out that edge's own tuple): paths are a few edges deep, and one C-level
        concatenation per edge costs less than a list grown and copied into a tuple."""
        bb = self._block_bytes
        end, node, pos = len(key) - len(key) % bb, self._root, 0
        starts = key.startswith
        ids: tuple[int, ...] = ()
        while pos < end:
            child = node.children.get(key[pos : pos + bb])
            if child is None:
                break
            edge = child.tokens
            if starts(edge, pos):  # whole edge (it cannot run into the partial tail)
                ids += child.block_ids
                pos += len(edge)
                node = child
                continue
            lo, hi = 1, min(len(child.block_ids) - 1, (end - pos) // bb)  # block 0 matched
            while lo < hi:  # binary search for the longest matching run of blocks
                mid = (lo + hi + 1) // 2
                if starts(edge[: mid * bb], pos):
                    lo = mid
                else:
                    hi = mid - 1
            return child, lo, ids + child.block_ids[:lo]
        return node, len(node.block_ids), ids

    def _split(self, node: Node, k: int) -> Node:
        """Cut node's edge after k blocks. The new front node takes the first k blocks and the
        node's place under its parent; `node` keeps the tail (and so its identity and end)."""
        assert 0 < k < len(node.block_ids)
        bb, parent = self._block_bytes, node.parent
        front = self._node_type(self._next_id, parent, node.tokens[: k * bb],
                                node.block_ids[:k], parent.depth + k, node.tick,
                                node.last_access)
        self._next_id += 1
        front.lock_count, front.hits = node.lock_count, node.hits
        front.hint, front.promoted = node.hint, node.promoted
        parent.children[node.tokens[:bb]] = front
        node.tokens, node.block_ids, node.parent = node.tokens[k * bb :], node.block_ids[k:], front
        front.children[node.tokens[:bb]] = node
        self._num_nodes += 1
        self._depths.add(front.depth)
        self._version += 1
        self._policy.touch(node)  # it holds fewer blocks now
        return front

    def _next_tick(self) -> int:
        self._tick = self._clock() if self._clock is not None else self._tick + 1
        return self._tick

    def check_integrity(self) -> None:
        """Recompute every invariant from scratch (radixkv.index.integrity); IntegrityError
        naming the first that fails."""
        check_tree(self._root, self._block_bytes, self._cached, self._policy, Counters(
            self._num_nodes, self._num_locked, self._num_cached, self._depths.counts))
