"""The KV event log: block stored / removed events with sequence numbers, for routers.

Shaped like vLLM's KV events (BlockStored / BlockRemoved / AllBlocksCleared): each stored block
also gets a chained 64-bit hash (namespace salt -> parent hash -> this block's tokens) so a
router can index prefixes without token ids. A bounded replay buffer lets a subscriber resume
from a sequence number; one that fell further behind is told it lagged and should rebuild from
a tree snapshot (DumpTree).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

from radixkv.index.results import BlockRemoved, BlockStored, TreeEvent, WindowStored
from radixkv.protocol.block_hashes import block_contents, chain_from, namespace_salt
from radixkv.protocol.errors import InvalidArgument
from radixkv.protocol.tokens import block_bytes

MAX_BATCH = 1024  # events one read() returns at most, so a resume never copies the whole buffer


@dataclass(frozen=True, slots=True)
class KVEvent:
    sequence: int
    namespace: str
    timestamp: float
    kind: str  # "stored" | "removed" | "cleared" | "window_stored" | "window_removed"
    block_ids: tuple[int, ...] = ()
    parent_block_id: int | None = None
    tokens: bytes = b""
    block_hashes: tuple[int, ...] = ()
    parent_block_hash: int | None = None
    window_ids: tuple[int, ...] = ()  # window_*: the window parts of block_ids' positions
    key_size: int = 0  # key-keyed namespaces: `tokens` holds the blocks' keys, this size each
    tier: str = ""  # removed: "disk" when the blocks left the pool for the disk tier below it


@dataclass(frozen=True, slots=True)
class Dropped:
    """A block the tier below the pool dropped (queued like a tree event)."""

    block_hashes: tuple[int, ...]


class EventSink(Protocol):
    """Applies each event as it is made (the lookup table: radixkv.service.table_writer)."""

    def apply(self, ev: KVEvent) -> None: ...


class EventLog:
    """Publishes tree events with consecutive sequence numbers (starting at 1) and keeps the
    last `capacity` of them for resuming subscribers. Thread-safe.

    Block hashes are computed in batches, not per call: `publish` queues the tree's events with
    their sequence numbers, and they are hashed (in order: a block's hash needs its parent's)
    when a reader asks, or once HASH_BATCH are queued. One numpy pass then hashes every queued
    block, where a call of its own would pay numpy's fixed cost (larger with the CPU caches
    cold) on the request path."""

    HASH_BATCH = 64  # queued events that trigger hashing without a reader

    def __init__(self, block_size: int, capacity: int = 65536) -> None:
        if capacity < 1:
            raise InvalidArgument(f"the event buffer must hold at least 1 event, got {capacity}")
        self.block_size = block_size
        self.capacity = capacity
        self._buffer: deque[KVEvent] = deque(maxlen=capacity)
        # (sequence, namespace, time, event (None: cleared), key size (0: token-keyed), tier)
        self._queued: list[tuple[int, str, float, TreeEvent | Dropped | None, int, str]] = []
        self._last = 0
        self._cond = threading.Condition()
        # per namespace with cached blocks, forgotten with its last block: block id -> hash,
        # and its salt (so the log keeps no names but those of live namespaces and its buffer)
        self._hash_of: dict[str, dict[int, int]] = {}
        self._salt_of: dict[str, int] = {}
        self._follower: EventSink | None = None

    def follow(self, follower: EventSink | None) -> None:
        """Hand every event to `follower` as it is published (hashed at once, not in batches:
        a follower must never lag the trees), in sequence order, under the log's lock."""
        with self._cond:
            self._follower = follower
            if self._queued:
                self._hash_queued()

    @property
    def last_sequence(self) -> int:
        return self._last

    def publish(self, namespace: str, events: Iterable[TreeEvent], key_size: int = 0,
                tier: str = "") -> None:
        """`key_size`: the namespace is key-keyed (its events' `tokens` are block keys);
        `tier`: where the removed blocks went ("disk": the tier below the pool, still hittable
        here; "": gone)."""
        with self._cond:
            now = time.time()
            for ev in events:
                self._last += 1
                self._queued.append((self._last, namespace, now, ev, key_size, tier))
            if (len(self._queued) >= min(self.HASH_BATCH, self.capacity)
                    or self._follower is not None):
                self._hash_queued()
            self._cond.notify_all()

    def publish_dropped(self, dropped: Iterable[tuple[str, int]]) -> None:
        """BlockRemoved for the (namespace, event hash) pairs the tier below the pool dropped,
        one event per namespace: no pool ids (they had none), their hashes, an empty tier:
        gone."""
        by_ns: dict[str, list[int]] = {}
        for namespace, block_hash in dropped:
            by_ns.setdefault(namespace, []).append(block_hash)
        if not by_ns:
            return
        with self._cond:
            now = time.time()
            for namespace, hashes in by_ns.items():
                self._last += 1
                self._queued.append((self._last, namespace, now, Dropped(tuple(hashes)), 0, ""))
            if self._follower is not None:
                self._hash_queued()
            self._cond.notify_all()

    def publish_cleared(self, namespace: str) -> None:
        """AllBlocksCleared for one namespace: its block hashes are forgotten."""
        with self._cond:
            self._last += 1
            self._queued.append((self._last, namespace, time.time(), None, 0, ""))
            if self._follower is not None:
                self._hash_queued()
            self._cond.notify_all()

    def _hash_queued(self) -> None:
        """Turn the queued tree events into KVEvents in the buffer, hashing their blocks: every
        stored block's content in one numpy pass, then each chain from its parent's hash (a
        key-keyed block's content hash is its key's, as a key of key_size / 4 uint32s)."""
        queued, self._queued = self._queued, []
        run = block_bytes(self.block_size)
        contents = block_contents(b"".join(ev.tokens[:len(ev.block_ids) * run]
                                      for *_, ev, ks, _ in queued
                                      if isinstance(ev, BlockStored) and not ks), self.block_size)
        at = 0
        for sequence, namespace, when, ev, key_size, tier in queued:
            if ev is None:
                self._forget(namespace)
                self._emit(KVEvent(sequence, namespace, when, "cleared"))
                continue
            if isinstance(ev, Dropped):
                self._emit(KVEvent(sequence, namespace, when, "removed",
                                            block_hashes=ev.block_hashes))
                continue
            known = self._hash_of.setdefault(namespace, {})
            if isinstance(ev, BlockStored):
                parent_hash = None if ev.parent_block_id is None else known[ev.parent_block_id]
                if key_size:
                    mine = block_contents(ev.tokens, key_size // 4)
                else:
                    mine = contents[at:at + len(ev.block_ids)]
                    at += len(ev.block_ids)
                if parent_hash is None and namespace not in self._salt_of:
                    self._salt_of[namespace] = namespace_salt(namespace)
                start = self._salt_of[namespace] if parent_hash is None else parent_hash
                hashes = chain_from(start, mine)
                known.update(zip(ev.block_ids, hashes, strict=True))
                self._emit(KVEvent(sequence, namespace, when, "stored", ev.block_ids,
                                            ev.parent_block_id, ev.tokens, tuple(hashes),
                                            parent_hash, key_size=key_size))
            elif isinstance(ev, BlockRemoved):
                self._emit(KVEvent(sequence, namespace, when, "removed", ev.block_ids,
                                            block_hashes=tuple(map(known.pop, ev.block_ids)),
                                            tier=tier))
                if not known:  # its last block went: so did the namespace (or it will)
                    self._forget(namespace)
            else:  # a window part came or went; the positions (full parts) stay
                kind = "window_stored" if isinstance(ev, WindowStored) else "window_removed"
                self._emit(KVEvent(sequence, namespace, when, kind, ev.block_ids,
                                            block_hashes=tuple(map(known.__getitem__,
                                                                   ev.block_ids)),
                                            window_ids=ev.window_ids))

    def _emit(self, ev: KVEvent) -> None:
        self._buffer.append(ev)
        if self._follower is not None:
            self._follower.apply(ev)

    def _forget(self, namespace: str) -> None:
        self._hash_of.pop(namespace, None)
        self._salt_of.pop(namespace, None)

    def block_hashes(self, namespace: str) -> Mapping[int, int]:
        """Block id -> the chained hash its BlockStored event carried, for every cached block
        of `namespace` (read-only). Valid while no event is published: call it under the
        service's lock and read it before letting go."""
        with self._cond:
            if self._queued:
                self._hash_queued()
            return MappingProxyType(self._hash_of.get(namespace, {}))

    def read(self, after: int, timeout: float | None = None,
             limit: int = MAX_BATCH) -> tuple[list[KVEvent], bool]:
        """The oldest (at most `limit`) events with sequence > `after`, waiting up to `timeout`
        s for one if none yet. Returns (events, lagged): lagged is True when events after
        `after` were already dropped from the buffer, so the subscriber must resync from a
        snapshot (DumpTree) and resume after its `last_sequence`."""
        with self._cond:
            if self._last <= after and timeout:
                self._cond.wait_for(lambda: self._last > after, timeout)
            if self._queued:
                self._hash_queued()
            if not self._buffer or self._last <= after:
                return [], False
            first = self._buffer[0].sequence
            if after + 1 < first:
                return [], True
            start = after + 1 - first
            stop = min(len(self._buffer), start + limit)
            return [self._buffer[i] for i in range(start, stop)], False

    def namespaces(self) -> list[str]:
        """The namespaces whose block hashes or salts the log keeps (those with cached
        blocks)."""
        with self._cond:
            if self._queued:
                self._hash_queued()
            return sorted(self._hash_of.keys() | self._salt_of.keys())

    def wake_all(self) -> None:
        """Wake blocked readers (at shutdown)."""
        with self._cond:
            self._cond.notify_all()
