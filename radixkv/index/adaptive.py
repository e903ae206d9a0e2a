"""The `adaptive` eviction policy: ARC restricted to the tree's evictable leaves.

    evict first ─▶ [ dead ]   leaves a client hinted `session_end` (and their single-child path)
                   [ T1   ]   leaves seen once: inserted, never matched since
                   [ T2   ]   leaves seen again (a hit), or admitted there (below), or `keep`
    B1, B2: ghosts  runs of blocks recently evicted from T1 / T2, by hash (bounded, counted)

Within a list, the least recently touched leaf goes first. Which list gives the victim follows
ARC: T1 while its blocks exceed the target `p`, else T2 (the other one when that is empty); `p`
starts at half the pool when its size is known (at 0, as in ARC, when it is not). One
exception: when T2 is to give the victim but T1's coldest leaf has been idle more than
STALE_FACTOR times as long as T2's, T1's goes (its target share is for recent leaves). A
new leaf whose first block is in a ghost list goes to T2 and moves `p`: a B1 hit means T1 was
too small (p grows), a B2 hit that T2 was (p shrinks), each by the blocks re-inserted times the
ratio of the ghost lists' sizes, as in ARC. A new leaf also goes to T2 when its request extends
or repeats earlier requests that ended at >= 2 different nodes of its path (`lineage`, counted
by the tree): a conversation's third turn onward. (Counting nodes, not requests: many short
requests that end at one shared system prompt are one ancestor, not a long conversation.)

A ghost entry is one run of blocks evicted together from a leaf's tail, keyed by a hash of
(namespace salt, depth, its first 32 tokens) of its first block, with its length. A prefix
comes back from its shallowest missing block, which is the first block of the run evicted last
on its path, so a new leaf looks up its first block, then the block after each run it found:
one hash per eviction step and per run that comes back, never one per block or over a whole
prefix. B1 and B2 remember at most 2 x `capacity_blocks` blocks each (the capacity defaults to
the most blocks the lists ever held): a conversation's next turn often comes back later than
one capacity's worth of evictions. `ghost_size()` counts the blocks they remember.

The state (p, the list sizes, the ghosts) is shared by the policies of every namespace of one
pool, so victims compare across trees: a key is (rank, tick) with rank 0 = dead, 1 = the list
ARC takes from now, 2 = the other; while ARC takes from T2, a seen-once leaf is rank 1 at its
idle time divided by STALE_FACTOR (the exception above).

Costs: add / remove / touch / pop O(log n) amortized (one lazy-deletion heap per list: heapq
runs in C, and nothing here needs ordered iteration or removal by rank, so no sorted
container); ghost insert O(1) per eviction step, lookup O(1) per run that comes back.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Any, TypeVar, cast

from radixkv.index.eviction import Evictable, EvictionPolicy
from radixkv.index.hints import KEEP, SESSION_END

T = TypeVar("T", bound=Evictable)

DEAD, ONCE, TWICE = 0, 1, 2
LINEAGE_ADMIT = 2  # nodes of its path where earlier requests ended that admit a leaf to T2
_MIX = 0x9E3779B97F4A7C15  # spreads depths over the key's bits
KEY_BYTES = 128  # a ghost key hashes at most this many bytes of a block (32 tokens)
GHOST_FACTOR = 2  # each ghost list remembers up to this many x capacity_blocks blocks
STALE_FACTOR = 3  # a seen-once leaf idle this many times longer than T2's coldest goes first


class AdaptiveState:
    """What the policies of one pool's trees share: the target split, list sizes and ghosts."""

    def __init__(self, capacity_blocks: int | None = None) -> None:
        self.capacity = capacity_blocks
        # target blocks in T1. ARC starts it at 0 (evict seen-once leaves first until B1 ghost
        # hits say otherwise); a pool of known size starts balanced instead: the ghosts of a
        # cluster member, which sees a share of the traffic, take long to move p off 0, and
        # meanwhile recent conversation tails went before stale hit leaves.
        self.p = capacity_blocks / 2 if capacity_blocks else 0.0
        self.blocks = [0, 0, 0]  # blocks in evictable leaves per list (DEAD, ONCE, TWICE)
        self.total = 0  # sum(self.blocks)
        self.peak = 0  # most blocks the lists held at once (sizes the ghosts without capacity)
        # B1, B2: key of a run's first block -> the run's blocks, oldest first
        self.ghosts: tuple[OrderedDict[int, int], ...] = (OrderedDict(), OrderedDict())
        self.ghost_blocks = [0, 0]  # blocks B1 / B2 remember
        self.ghost_hits = [0, 0]  # blocks re-inserted from B1 / B2
        self.lineage_admits = 0
        self.newest = 0  # the newest tick any leaf was pushed with: "now" for idle times

    def new_policy(self, namespace: str = "") -> AdaptivePolicy[Any]:
        return AdaptivePolicy(self, namespace)

    def size(self) -> int:
        """The cache size ARC works with: the pool's capacity, else the most blocks seen."""
        return self.capacity if self.capacity is not None else max(64, self.peak)

    def take_from(self) -> int:
        """The list ARC evicts from now (ONCE or TWICE), ignoring which are empty."""
        return ONCE if self.blocks[ONCE] > self.p else TWICE

    def remember(self, which: int, key: int, num_blocks: int) -> None:
        """A run of `num_blocks` evicted from list `which`, keyed by its first block."""
        ghost, i = self.ghosts[which - 1], which - 1
        self.ghost_blocks[i] += num_blocks - ghost.pop(key, 0)  # a newer run from there wins
        ghost[key] = num_blocks
        limit = GHOST_FACTOR * self.size()
        while self.ghost_blocks[i] > limit:
            self.ghost_blocks[i] -= ghost.popitem(last=False)[1]

    def recall(self, key: int) -> tuple[int, int]:
        """(ONCE or TWICE, the run's blocks) if a run starting at `key` is in B1 / B2 (and
        drop it there); (DEAD, 0) if in neither."""
        for which in (ONCE, TWICE):
            num_blocks = self.ghosts[which - 1].pop(key, 0)
            if num_blocks:
                self.ghost_blocks[which - 1] -= num_blocks
                return which, num_blocks
        return DEAD, 0

    def adapt(self, which: int, num_blocks: int) -> None:
        """ARC's adaptation for `num_blocks` ghost hits in B1 (which=ONCE) or B2."""
        b1, b2 = self.ghost_blocks
        self.ghost_hits[which - 1] += num_blocks
        if which == ONCE:
            self.p = min(float(self.size()), self.p + num_blocks * max(1.0, b2 / max(1, b1)))
        else:
            self.p = max(0.0, self.p - num_blocks * max(1.0, b1 / max(1, b2)))


class AdaptivePolicy(EvictionPolicy[T]):
    """One tree's leaves in three lazy-deletion heaps; see the module docstring."""

    name = "adaptive"
    learns = True

    def __init__(self, state: AdaptiveState, namespace: str = "") -> None:
        self.state = state
        self._salt = hash(namespace)
        self._heaps: tuple[list[tuple[Any, ...]], ...] = ([], [], [])
        # node_id -> (tick, node_id, item, list, blocks): its live entry
        self._live: dict[int, tuple[Any, ...]] = {}
        self._count = [0, 0, 0]  # live items per list

    # -- classification ---------------------------------------------------------------------

    @staticmethod
    def list_of(item: Evictable) -> int:
        if item.hint == SESSION_END:
            return DEAD
        if item.hits or item.promoted or item.hint == KEEP:
            return TWICE
        return ONCE

    def _key(self, item: T, first: int) -> int:
        """Ghost key of the item's block `first` (0-based within its edge): the hash of its
        first KEY_BYTES of tokens (a key costs the same at any block size; blocks that share
        them at one depth share a key, which costs at most a wrong promotion) mixed with its
        depth and the namespace salt in integer arithmetic (no tuple to allocate)."""
        num_blocks = len(item.block_ids)
        bb = len(item.tokens) // num_blocks
        start, depth = first * bb, item.depth - num_blocks + first
        end = start + (bb if bb < KEY_BYTES else KEY_BYTES)
        return hash(item.tokens[start:end]) ^ (depth * _MIX + self._salt)

    # -- the set ----------------------------------------------------------------------------

    def _push(self, item: T) -> None:
        which, size = self.list_of(item), len(item.block_ids)
        entry = (item.tick, item.node_id, item, which, size)
        self._live[item.node_id] = entry
        self._count[which] += 1
        state = self.state
        if item.tick > state.newest:
            state.newest = item.tick
        state.blocks[which] += size
        state.total += size
        if state.total > state.peak:
            state.peak = state.total
        heap = self._heaps[which]
        heapq.heappush(heap, entry)
        if len(heap) > 2 * self._count[which] + 1024:  # too many stale entries: rebuild
            self._heaps[which][:] = [e for e in self._live.values() if e[3] == which]
            heapq.heapify(self._heaps[which])

    def _drop(self, node_id: int) -> tuple[Any, ...]:
        entry = self._live.pop(node_id)
        self._count[entry[3]] -= 1
        self.state.blocks[entry[3]] -= entry[4]
        self.state.total -= entry[4]
        return entry

    def add(self, item: T) -> None:
        assert item.node_id not in self._live, f"node {item.node_id} already evictable"
        self._push(item)

    def remove(self, item: T) -> None:
        self._drop(item.node_id)

    def touch(self, item: T) -> None:
        if item.node_id in self._live:
            self._drop(item.node_id)
            self._push(item)

    def _front(self, which: int) -> tuple[Any, ...] | None:
        heap, live = self._heaps[which], self._live
        while heap and live.get(heap[0][1]) is not heap[0]:
            heapq.heappop(heap)  # stale
        return heap[0] if heap else None

    def _order(self, which: int, tick: int) -> tuple[int, float]:
        """The eviction order across lists (and across the trees sharing the state): (0, tick)
        for DEAD, (1, tick) for the list ARC takes from now, (2, tick) for the other; but a
        seen-once leaf while ARC takes from T2 keys as (1, its idle time / STALE_FACTOR before
        now): it goes before T2 leaves idle less than a STALE_FACTOR-th as long (T1's target
        share is for recent seen-once leaves, not for one nobody came back to)."""
        if which == DEAD:
            return (0, tick)
        if which == self.state.take_from():
            return (1, tick)
        if which == ONCE:
            now = self.state.newest
            return (1, now - (now - tick) / STALE_FACTOR)
        return (2, tick)

    def _victim(self) -> tuple[tuple[int, float], tuple[Any, ...]] | None:
        """(key, entry) of the leaf `pop` takes next; None when empty."""
        best: tuple[tuple[int, float], tuple[Any, ...]] | None = None
        for which in (DEAD, ONCE, TWICE):
            entry = self._front(which) if self._count[which] else None
            if entry is not None:
                key = self._order(which, entry[0])
                if best is None or key < best[0]:
                    best = (key, entry)
        return best

    def pop(self) -> T:
        victim = self._victim()
        if victim is None:
            raise IndexError("pop from an empty eviction policy")
        self._drop(victim[1][1])
        return cast(T, victim[1][2])

    def peek_key(self) -> tuple[Any, ...] | None:
        victim = self._victim()
        return None if victim is None else victim[0]

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, item: T) -> bool:
        return item.node_id in self._live

    # -- learning ---------------------------------------------------------------------------

    def admit(self, item: T, lineage: int) -> None:
        state, num_blocks = self.state, len(item.block_ids)
        which, hits = state.recall(self._key(item, 0))
        if which:
            while hits < num_blocks:  # runs evicted before it, deeper on the same path
                more, run = state.recall(self._key(item, hits))
                if more != which:
                    break
                hits += run
            state.adapt(which, min(hits, num_blocks))
            item.promoted = True
        elif lineage >= LINEAGE_ADMIT:
            state.lineage_admits += 1
            item.promoted = True

    def evicted(self, item: T, keep: int) -> None:
        which = self.list_of(item)
        if which == DEAD:
            return  # the client said so: nothing to learn from its return
        self.state.remember(which, self._key(item, keep), len(item.block_ids) - keep)

    def ghost_size(self) -> int:
        return sum(self.state.ghost_blocks)
