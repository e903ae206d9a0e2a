"""The service's side of the lookup table: one writer, fed the event log's events as they are
published (under the service's lock), so the table follows the trees, the disk tier and Clears.

A stored block's key gets its pool block id; one demoted to the disk tier keeps its key with
tier "disk"; a block gone from both, and a cleared namespace's blocks, lose theirs. Windowed
namespaces are not published (their window parts come and go apart from the tree's blocks).
"""

from __future__ import annotations

import os

from kvpool import reclaim_stale_segments
from kvpool.segment import OwnedSegment
from radixkv.service.events import KVEvent
from radixkv.table import table_format as L
from radixkv.table.table_format import BUCKET_WORDS, WAYS


class TableWriter:
    """The table for at most `entries` keys (the pool's blocks and the disk tier's), blocks of
    `block_size` tokens, pool `epoch`; readers find it by its segment's name and size, which
    PoolInfo carries."""

    def __init__(self, entries: int, block_size: int, epoch: str,
                 prefix: str = "radixkv", mode: int = 0o600) -> None:
        self.num_buckets = L.num_buckets_for(entries)
        reclaim_stale_segments(prefix)  # a killed service's table (a CUDA pool reclaims no slab)
        self.segment = OwnedSegment(L.table_bytes(self.num_buckets), prefix, mode)
        self._words = memoryview(self.segment.mm).cast("Q")
        self._mask = self.num_buckets - 1
        self._where: dict[int, int] = {}  # key -> its word index (the way's key word)
        self._keys_of: dict[str, set[int]] = {}  # namespace -> its keys (for a Clear)
        self.overflows = 0  # keys dropped because their bucket was full
        w = self._words
        w[L.H_VERSION], w[L.H_BUCKETS], w[L.H_PID] = L.VERSION, self.num_buckets, os.getpid()
        w[L.H_BLOCK_SIZE] = block_size
        w[L.H_EPOCH], w[L.H_EPOCH + 1] = L.epoch_words(epoch)
        w[L.H_STATE] = L.LIVE
        w[L.H_MAGIC] = L.MAGIC  # last: a reader that sees it sees the rest

    @property
    def num_keys(self) -> int:
        return len(self._where)

    def put(self, namespace: str, key: int, value: int) -> None:
        """Set `key`'s value (adding the key if new; a full bucket drops it: a miss)."""
        if key == 0:
            return  # 0 marks an empty way
        w = self._words
        at = self._where.get(key)
        bucket = key & self._mask
        base = L.HEADER_BYTES // 8 + bucket * BUCKET_WORDS
        if at is None:
            at = next((i for i in range(base + 1, base + 1 + WAYS) if w[i] == 0), None)
            if at is None:  # the bucket is full
                self.overflows += 1
                return
            self._where[key] = at
            self._keys_of.setdefault(namespace, set()).add(key)
        w[base] += 1  # odd: readers retry
        w[at] = key
        w[at + WAYS] = value
        w[base] += 1

    def remove(self, namespace: str, key: int) -> None:
        at = self._where.pop(key, None)
        if at is None:
            return
        keys = self._keys_of.get(namespace)
        if keys is not None:
            keys.discard(key)
        bucket = key & self._mask
        base = L.HEADER_BYTES // 8 + bucket * BUCKET_WORDS
        w = self._words
        w[base] += 1
        w[at + WAYS] = 0
        w[at] = 0
        w[base] += 1

    def clear(self, namespace: str) -> None:
        for key in list(self._keys_of.pop(namespace, ())):
            self.remove(namespace, key)

    def apply(self, ev: KVEvent) -> None:
        """One event of the log, in order (stored, removed to the disk tier or for good,
        cleared; window parts change nothing here)."""
        if ev.kind == "stored":
            for key, block in zip(ev.block_hashes, ev.block_ids, strict=True):
                self.put(ev.namespace, key, L.value(block, L.POOL, ev.sequence))
        elif ev.kind == "removed" and ev.tier == "disk":
            for key in ev.block_hashes:
                self.put(ev.namespace, key, L.value(None, L.DISK, ev.sequence))
        elif ev.kind == "removed":
            for key in ev.block_hashes:
                self.remove(ev.namespace, key)
        elif ev.kind == "cleared":
            self.clear(ev.namespace)
        self.advance(ev.sequence)

    def advance(self, sequence: int) -> None:
        """The last event applied (readers compare it before and after a read)."""
        self._words[L.H_SEQUENCE] = sequence

    def close(self) -> None:
        """Readers see the table closed (they ask the service again); the segment is unlinked."""
        if self.segment.mm.closed:
            return
        self._words[L.H_STATE] = L.CLOSED
        self._words.release()
        self.segment.mm.close()
        self.segment.close()
