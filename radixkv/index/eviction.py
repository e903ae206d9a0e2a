"""Eviction policies: the order in which the tree's evictable leaves go.

The tree owns the evictable-leaf set (unlocked, childless, non-root nodes) and keeps a policy in
step with it: `add` when a node becomes an evictable leaf, `remove` when it stops being one,
`touch` after its key fields (`tick`, `hits`, `hint`, its size) changed while it is in the set,
`pop` for the next victim; `admit` before a new leaf's `add` and `evicted` before a popped leaf
loses blocks let a policy learn from insertions and evictions (radixkv.index.adaptive). A policy
never scans the tree. LRU and LFU here are a binary heap with lazy deletion:
a re-keyed or removed item leaves a stale heap entry that `pop` skips (an entry is live only while
it is the one stored for its node id), and the heap is rebuilt when stale entries outnumber live
ones, so every operation is O(log n) amortized.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Generic, Protocol, TypeVar, cast


class Evictable(Protocol):
    """What a policy may read from a node."""

    @property
    def node_id(self) -> int: ...  # unique, stable; breaks ties
    @property
    def tick(self) -> int: ...  # logical time of the last touch (monotonic)
    @property
    def hits(self) -> int: ...  # times the node was locked by a match
    @property
    def hint(self) -> int: ...  # the client's retention hint (NO_HINT, SESSION_END, KEEP)
    @property
    def depth(self) -> int: ...  # blocks from the root to the end of the node's edge
    @property
    def tokens(self) -> bytes: ...  # the edge's tokens (whole blocks)
    @property
    def block_ids(self) -> Any: ...  # the edge's block ids (len() = its blocks)
    promoted: bool  # the policy's own mark (adaptive: admitted to the frequent list)
    ends: int  # requests whose prompt ended at this node's end


T = TypeVar("T", bound=Evictable)


class EvictionPolicy(ABC, Generic[T]):
    """An ordered set of evictable leaves. `pop` removes and returns the next victim."""

    name: ClassVar[str]
    learns: ClassVar[bool] = False  # wants `admit` / `evicted` (else the tree skips them)

    @abstractmethod
    def add(self, item: T) -> None:
        """Insert an item that is not in the set."""

    @abstractmethod
    def remove(self, item: T) -> None:
        """Remove an item that is in the set."""

    @abstractmethod
    def touch(self, item: T) -> None:
        """Re-key an item after its fields changed; no-op for an item not in the set."""

    @abstractmethod
    def pop(self) -> T:
        """Remove and return the next victim; IndexError when empty."""

    @abstractmethod
    def peek_key(self) -> tuple[Any, ...] | None:
        """The next victim's sort key (without node id), or None when empty. Read-only."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, item: T) -> bool: ...

    def admit(self, item: T, lineage: int) -> None:
        """Called once for a new leaf, before its `add`: `lineage` nodes of its path are where
        earlier requests ended (a conversation's later turn extends its earlier turns).
        Default: nothing."""

    def evicted(self, item: T, keep: int) -> None:
        """Called after `pop` returned `item` and before its blocks [keep:] go. Default:
        nothing."""

    def ghost_size(self) -> int:
        """Evicted-block entries the policy remembers (bounded; 0 for policies without)."""
        return 0


class _HeapPolicy(EvictionPolicy[T]):
    """Min-heap of `_entry(item)` tuples, which end with (node_id, item)."""

    def __init__(self) -> None:
        self._heap: list[tuple[Any, ...]] = []
        self._live: dict[int, tuple[Any, ...]] = {}  # node_id -> its current heap entry

    @abstractmethod
    def _entry(self, item: T) -> tuple[Any, ...]: ...

    def _push(self, item: T) -> None:
        entry = self._entry(item)
        self._live[item.node_id] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * len(self._live) + 1024:
            self._heap = list(self._live.values())
            heapq.heapify(self._heap)

    def add(self, item: T) -> None:
        assert item.node_id not in self._live, f"node {item.node_id} already evictable"
        self._push(item)

    def remove(self, item: T) -> None:
        del self._live[item.node_id]

    def touch(self, item: T) -> None:
        if item.node_id in self._live:
            self._push(item)

    def pop(self) -> T:
        heap, live = self._heap, self._live
        while heap:
            entry = heapq.heappop(heap)
            if live.get(entry[-2]) is entry:
                del live[entry[-2]]
                return cast(T, entry[-1])
        raise IndexError("pop from an empty eviction policy")

    def peek_key(self) -> tuple[Any, ...] | None:
        heap, live = self._heap, self._live
        while heap and live.get(heap[0][-2]) is not heap[0]:
            heapq.heappop(heap)  # drop stale entries; the live set is unchanged
        return heap[0][:-2] if heap else None

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, item: T) -> bool:
        return item.node_id in self._live


class LRUPolicy(_HeapPolicy[T]):
    """Least recently touched first (smallest tick)."""

    name = "lru"

    def _entry(self, item: T) -> tuple[Any, ...]:
        return (item.tick, item.node_id, item)


class LFUPolicy(_HeapPolicy[T]):
    """Fewest hits first; ties go least recently touched first."""

    name = "lfu"

    def _entry(self, item: T) -> tuple[Any, ...]:
        return (item.hits, item.tick, item.node_id, item)
