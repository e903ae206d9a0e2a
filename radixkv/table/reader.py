"""An engine's side of the lookup table: the service's table mapped read-only, read with no lock
and no call (the protocol: radixkv/table/table_format.py).

An answer is advisory. It says which of a prompt's blocks the cache held while it was read; the
engine still pins them with a Match, which matches tokens, so a block evicted in between is a
miss there (the engine computes it), never another prompt's KV.

Two reads give the same answers: the compiled one (native.py: hashing and lookup in one call,
stopping at the first block not found) and, where it is not built, numpy's (`lookup`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvpool.segment import map_readonly, owner_alive
from radixkv.protocol.block_hashes import (
    Keys,
    namespace_salt,
    path_keys,
    position_keys,
    token_keys,
)
from radixkv.protocol.errors import StalePool, Unavailable
from radixkv.table import table_format as L
from radixkv.table.native import peek_function
from radixkv.table.table_format import BUCKET_WORDS, WAYS

# reads of a bucket the writer keeps changing before its keys count as misses: the compiled
# read spins (a pause between reads: ~30 us in all), numpy's reads all buckets again each time
SPINS = 1024
TRIES = 8
_ONE = np.uint64(1)
_ID_MASK = np.uint64(0xFFFFFFFF)

Ids = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True, eq=False)
class Peek:
    """What the table held for a prompt: its leading run of blocks cached anywhere (`num_blocks`,
    `num_tokens`), of them the leading run in the pool itself (`num_pool_blocks`) and that run's
    pool block ids (advisory: pin with a Match before reading them), in the pool of `epoch`."""

    num_blocks: int
    num_tokens: int
    num_pool_blocks: int
    ids: Ids
    epoch: str

    @property
    def block_ids(self) -> tuple[int, ...]:
        return tuple(self.ids.tolist())


class TableReader:
    def __init__(self, name: str, nbytes: int, epoch: str) -> None:
        if not L.supported():
            raise Unavailable("the lookup table is read only on x86-64 (its read protocol "
                              "relies on that machine's memory ordering)")
        self.mm, self._fd = map_readonly(name, nbytes)
        words = np.frombuffer(self.mm, np.uint64)
        if words[L.H_MAGIC] != L.MAGIC or words[L.H_VERSION] != L.VERSION:
            raise Unavailable(f"shared-memory segment {name!r} is not a radixkv lookup table "
                              "of this version")
        if (int(words[L.H_EPOCH]), int(words[L.H_EPOCH + 1])) != L.epoch_words(epoch):
            raise StalePool(f"lookup table {name!r} is not that of pool epoch {epoch}")
        self.epoch = epoch
        self.header = words[:L.HEADER_BYTES // 8]
        self.block_size = int(self.header[L.H_BLOCK_SIZE])
        self.owner_pid = int(self.header[L.H_PID])
        self._buckets = words[L.HEADER_BYTES // 8:].reshape(-1, BUCKET_WORDS)
        self._seq = self._buckets[:, 0]
        self._mask = np.uint64(len(self._buckets) - 1)
        self.reads = 0
        self.bucket_reads = 0
        self.retries = 0  # bucket reads redone because the writer was changing them
        self.gave_up = 0  # reads that ended at a bucket still in change after all the tries
        fn = peek_function()
        self._native = _Native(fn, self._buckets, epoch) if fn is not None else None

    def check_live(self) -> None:
        """StalePool once the writer closed the table or died (its lock on the segment is
        gone: checked at every read)."""
        if self.header[L.H_STATE] != L.LIVE:
            raise StalePool(f"the lookup table of pool epoch {self.epoch} is closed: the "
                            "service stopped or restarted")
        if not owner_alive(self._fd):
            raise StalePool(f"the service (pid {self.owner_pid}) that wrote the lookup "
                            f"table of pool epoch {self.epoch} is gone")

    @property
    def sequence(self) -> int:
        """The last event the writer applied."""
        return int(self.header[L.H_SEQUENCE])

    def peek(self, namespace: str, tokens: npt.NDArray[np.uint32] | bytes) -> Peek:
        """The leading run of `tokens`' whole blocks (uint32, or their little-endian bytes) the
        table holds in token-keyed `namespace`."""
        self.check_live()
        if self._native is not None:
            return self._count(self._native.peek(namespace, tokens, self.block_size))
        if isinstance(tokens, bytes):
            tokens = np.frombuffer(tokens, "<u4")
        return self._peek(token_keys(namespace, tokens, self.block_size))

    def peek_keys(self, namespace: str, keys: Sequence[bytes]) -> Peek:
        """The same for a key path (one key per block, all of one size) in key-keyed
        `namespace`."""
        self.check_live()
        if self._native is not None and keys:
            return self._count(self._native.peek(namespace, b"".join(keys), len(keys[0]) // 4))
        return self._peek(path_keys(namespace, keys))

    def _count(self, read: tuple[Peek, int, int, int]) -> Peek:
        peek, bucket_reads, retries, gave_up = read
        self.reads += 1
        self.bucket_reads += bucket_reads
        self.retries += retries
        self.gave_up += gave_up
        return peek

    def lookup(self, keys: Keys) -> tuple[int, npt.NDArray[np.uint64]]:
        """The leading run of `keys` in the table (each read from a bucket the writer was not
        changing; a bucket that stayed in change for TRIES reads ends the run) and its
        values, in numpy."""
        self.reads += 1
        self.bucket_reads += len(keys)
        buckets = keys & self._mask
        for _ in range(TRIES):
            before = self._seq[buckets]
            rows = self._buckets[buckets]  # whole buckets: one contiguous copy
            if np.array_equal(before, self._seq[buckets]) and not (before & _ONE).any():
                return _run(keys, rows, None)
            self.retries += len(keys)
        stable = (before == self._seq[buckets]) & ((before & _ONE) == 0)
        n, values = _run(keys, rows, stable)
        self.gave_up += n < len(keys) and not stable[n]
        return n, values

    def _peek(self, keys: Keys) -> Peek:
        n, values = self.lookup(keys)
        ids = (values & _ID_MASK).astype(np.int64) - 1
        p = int(np.argmin(ids >= 0)) if (ids < 0).any() else n  # -1: on the disk tier only
        return Peek(n, n * self.block_size, p, ids[:p], self.epoch)

    def close(self) -> None:
        """Unmap (once the arrays over the mapping are gone)."""
        self.header = self._seq = self._buckets = None  # type: ignore[assignment]
        self._native = None
        with contextlib.suppress(OSError):
            os.close(self._fd)
        with contextlib.suppress(BufferError):
            self.mm.close()


def _run(keys: Keys, rows: npt.NDArray[np.uint64],
         stable: npt.NDArray[np.bool_] | None) -> tuple[int, npt.NDArray[np.uint64]]:
    hit = rows[:, 1:1 + WAYS] == keys[:, None]
    if stable is not None:
        hit &= stable[:, None]
    values = rows[:, 1 + WAYS:1 + 2 * WAYS][hit]  # a key is in one way at most
    if len(values) == len(keys):
        return len(keys), values
    n = int(hit.any(axis=1).argmin())
    return n, values[:n]


class _Native:
    """The compiled read, with scratch buffers at fixed addresses (one read at a time: a lock),
    so a call passes cached pointers instead of asking numpy for each."""

    def __init__(self, fn: Any, buckets: npt.NDArray[np.uint64], epoch: str) -> None:
        self.epoch = epoch
        self.fn = fn
        self.lock = threading.Lock()
        self.buckets = buckets.ctypes.data
        self.mask = len(buckets) - 1
        self.salts: dict[str, int] = {}
        self.keys: dict[int, int] = {}  # block size -> its position keys' address
        self.counters = np.zeros(3, np.int64)
        self.counters_at = self.counters.ctypes.data
        self._grow(4096)

    def _grow(self, words: int) -> None:
        self.tokens = np.zeros(words, np.uint32)
        self.tokens_at = self.tokens.ctypes.data
        self.out = np.zeros(2 * words, np.int64)  # the hashes, then the ids
        self.out_at = self.out.ctypes.data

    def peek(self, namespace: str, tokens: npt.NDArray[np.uint32] | bytes,
             block_size: int) -> tuple[Peek, int, int, int]:
        """(the answer, bucket reads, of them redone, whether it gave up on one)."""
        salt = self.salts.get(namespace)
        if salt is None:
            salt = self.salts[namespace] = namespace_salt(namespace)
        keys = self.keys.get(block_size)
        if keys is None:
            keys = self.keys[block_size] = position_keys(block_size).ctypes.data
        count = len(tokens) // 4 if isinstance(tokens, bytes) else len(tokens)
        num_blocks = count // block_size
        with self.lock:
            if count > len(self.tokens):
                self._grow(count)
            if isinstance(tokens, bytes):
                ctypes.memmove(self.tokens_at, tokens, 4 * count)
            else:
                self.tokens[:count] = tokens
            self.counters[:] = 0
            n = self.fn(self.tokens_at, num_blocks, block_size, keys, salt, self.buckets,
                        self.mask, SPINS, self.out_at, self.out_at + 8 * len(self.tokens),
                        self.counters_at)
            retries, pool, gave_up = self.counters.tolist()
            ids = self.out[len(self.tokens):len(self.tokens) + pool].copy()
        peek = Peek(n, n * block_size, pool, ids, self.epoch)
        return peek, n + (n < num_blocks), retries, gave_up
