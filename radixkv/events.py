"""The KV event log: block stored / removed events with sequence numbers, for routers.

Shaped like vLLM's KV events (BlockStored / BlockRemoved / AllBlocksCleared): each stored block
also gets a chained 64-bit hash (namespace salt -> parent hash -> this block's tokens) so a
router can index prefixes without token ids. A bounded replay buffer lets a subscriber resume
from a sequence number; one that fell further behind is told it lagged and should rebuild from
a tree snapshot (DumpTree).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from radixkv.errors import InvalidArgument
from radixkv.index.tree import BlockRemoved, BlockStored, TreeEvent, WindowStored
from radixkv.tokens import block_bytes

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


def _hash(parent: bytes, tokens: bytes | memoryview) -> bytes:
    return hashlib.blake2b(parent + tokens, digest_size=8).digest()


def chain_hashes(namespace: str, tokens: bytes | memoryview, block_size: int,
                 parent_hash: int | None = None) -> list[int]:
    """The chained 64-bit hash of each full block of `tokens` (little-endian uint32 bytes)
    following the block whose hash is `parent_hash` (None: at the root): the same numbers
    BlockStored events carry, so a router can hash a prompt and look its blocks up."""
    h = (hashlib.blake2b(namespace.encode(), digest_size=8).digest() if parent_hash is None
         else parent_hash.to_bytes(8, "little"))
    run = block_bytes(block_size)
    view = memoryview(tokens)
    hashes = []
    for start in range(0, len(view) - run + 1, run):
        h = _hash(h, view[start:start + run])
        hashes.append(int.from_bytes(h, "little"))
    return hashes


class EventLog:
    """Publishes tree events with consecutive sequence numbers (starting at 1) and keeps the
    last `capacity` of them for resuming subscribers. Thread-safe."""

    def __init__(self, block_size: int, capacity: int = 65536) -> None:
        if capacity < 1:
            raise InvalidArgument(f"the event buffer must hold at least 1 event, got {capacity}")
        self.block_size = block_size
        self.capacity = capacity
        self._buffer: deque[KVEvent] = deque(maxlen=capacity)
        self._last = 0
        self._cond = threading.Condition()
        self._hash_of: dict[str, dict[int, int]] = {}  # namespace -> block id -> hash

    @property
    def last_sequence(self) -> int:
        return self._last

    def publish(self, namespace: str, events: Iterable[TreeEvent]) -> None:
        with self._cond:
            for ev in events:
                self._append(namespace, ev)
            self._cond.notify_all()

    def publish_cleared(self, namespace: str) -> None:
        """AllBlocksCleared for one namespace: its block hashes are forgotten."""
        with self._cond:
            self._last += 1
            self._buffer.append(KVEvent(self._last, namespace, time.time(), "cleared"))
            self._hash_of.pop(namespace, None)
            self._cond.notify_all()

    def _append(self, namespace: str, ev: TreeEvent) -> None:
        self._last += 1
        now = time.time()
        known = self._hash_of.setdefault(namespace, {})
        if isinstance(ev, BlockStored):
            parent_hash = None if ev.parent_block_id is None else known[ev.parent_block_id]
            run = block_bytes(self.block_size)
            hashes = chain_hashes(namespace, memoryview(ev.tokens)[:len(ev.block_ids) * run],
                                  self.block_size, parent_hash)
            known.update(zip(ev.block_ids, hashes, strict=True))
            self._buffer.append(KVEvent(self._last, namespace, now, "stored", ev.block_ids,
                                        ev.parent_block_id, ev.tokens, tuple(hashes), parent_hash))
        elif isinstance(ev, BlockRemoved):
            pop = known.pop
            self._buffer.append(KVEvent(self._last, namespace, now, "removed", ev.block_ids,
                                        block_hashes=tuple(map(pop, ev.block_ids))))
        else:  # a window part came or went; the positions (full parts) stay
            kind = "window_stored" if isinstance(ev, WindowStored) else "window_removed"
            self._buffer.append(KVEvent(self._last, namespace, now, kind, ev.block_ids,
                                        block_hashes=tuple(map(known.__getitem__, ev.block_ids)),
                                        window_ids=ev.window_ids))

    def read(self, after: int, timeout: float | None = None,
             limit: int = MAX_BATCH) -> tuple[list[KVEvent], bool]:
        """The oldest (at most `limit`) events with sequence > `after`, waiting up to `timeout`
        s for one if none yet. Returns (events, lagged): lagged is True when events after
        `after` were already dropped from the buffer, so the subscriber must resync from a
        snapshot (DumpTree) and resume after its `last_sequence`."""
        with self._cond:
            if self._last <= after and timeout:
                self._cond.wait_for(lambda: self._last > after, timeout)
            if not self._buffer or self._last <= after:
                return [], False
            first = self._buffer[0].sequence
            if after + 1 < first:
                return [], True
            start = after + 1 - first
            stop = min(len(self._buffer), start + limit)
            return [self._buffer[i] for i in range(start, stop)], False

    def wake_all(self) -> None:
        """Wake blocked readers (at shutdown)."""
        with self._cond:
            self._cond.notify_all()
