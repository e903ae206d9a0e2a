"""The disk tier below the pool: write-back demotion, promotion inside Match, warm restart.

    pool (memory tier) --evicted by the pool's policy--> demote --> disk slot (write-back)
    disk slot --a Match whose prefix continues there--> promote --> pool blocks in the tree
    disk slot --the disk tier is full--> dropped (least recently demoted first: disk/index.py)

Every cached block is in exactly one tier: in a namespace's tree (memory) or in the disk index
(disk), never both; `check_integrity` proves it with the pool's free / leased / cached count.

Demote, under the service lock, puts the block in the disk index with its payload pending
(the pool block to copy it from) and goes on; the blocks go back to the free list (often
straight to the Allocate that evicted them). Once the service call leaves its locked section,
its own thread copies the pending payloads out of the pool (`settle`, off the service lock,
numpy letting the GIL go) before it answers, and before a Match reads a promotion into pool
blocks, then queues the writes: a writer thread computes the CRC and writes batches of slots
with os.pwritev, off the service lock. Until its copy is made a block is not on disk for a
Match (a miss: the plan stops there) nor for the writer; from then until its write is done it
is served from that copy. Nobody writes a pool block whose bytes another call has still to copy
out: a block is handed out (to a lease, or read into by a promotion) only after `claimed`,
which waits, under the service lock, for the other calls' copies out of it (`settle` never
takes that lock).

Promote: radixkv/disk/promotion.py (plan, read, apply).

Warm restart: `close(write_down=True)` (SIGTERM) writes every cached pool block to a slot and
fsyncs; the next start on the same directory scans the slot headers (`meta_crc`, the chain
hash recomputed from the parent's hash and the tokens, the generation) and rebuilds the index,
so the first Match of a prompt promotes it. After a crash the same scan runs: a torn slot fails
a check and is dropped; a complete one is served only after its full CRC verifies.

Clear: its slots' tombstones are queued like any, then `sync_drops` (off the service lock)
waits until every write queued before it is done and fsyncs, so a crash after Clear answers
cannot bring the namespace back. A write that fails (EIO) is retried with backoff; meanwhile
the tier reports `state` "failing" and the error, drops new demotions (a miss, never wrong
KV) and serves what it holds; once a retry succeeds it is "ok" again.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from kvpool.base import BlockPool
from radixkv.disk.index import DiskIndex, Entry, Key
from radixkv.disk.promotion import Promotions
from radixkv.disk.slots import FILE_NAME, ZERO_HASH, BlockKey, SlotFile, SlotMeta, chain_hash
from radixkv.disk.writer import SlotWriter
from radixkv.index.results import InsertResult
from radixkv.protocol.errors import IntegrityError
from radixkv.protocol.tokens import block_bytes
from radixkv.protocol.values import DiskStats
from radixkv.service.tier import NoTier

log = logging.getLogger("radixkv.disk")

CHECKERS = 2  # threads checking the checksums of blocks read (xxhash releases the GIL)


class DiskTier(Promotions, NoTier):
    present = True

    def __init__(self, pool: BlockPool, directory: str, capacity_blocks: int,
                 promote_blocks: int = 1 << 20) -> None:
        self.pool = pool
        self.block_size = pool.layout.block_size
        self._bb = block_bytes(self.block_size)
        # a block's payload bytes, by whether it is a sink block (the sink region is last)
        self._payload_len = {pool.is_sink(b): len(pool.block_bytes(b))
                             for b in (0, pool.num_full_blocks - 1)}
        self.promote_blocks = promote_blocks
        self.file = SlotFile(os.path.join(directory, FILE_NAME), pool.layout, capacity_blocks)
        self.index = DiskIndex(capacity_blocks)
        self._mem: dict[int, BlockKey] = {}  # pool block id -> its key (cached blocks)
        self._seq = 0
        # pool blocks a promotion reads into (plan to apply) -> their slot's format (sink?)
        self._reserved: dict[int, bool] = {}
        self._promoting: dict[str, int] = {}  # namespace -> its promotions in flight
        # blocks dropped that the events had marked as here: (namespace, their event hash)
        self._dropped: list[tuple[str, int]] = []
        # slot -> promotions reading it now (a slot freed and taken again can be read by two):
        # writes to these wait (under _cond)
        self._busy: dict[int, int] = {}
        self._checkers = ThreadPoolExecutor(CHECKERS, thread_name_prefix="disk-check")
        self._counts = dict(hit_tokens=0, promoted_blocks=0, demoted_blocks=0,
                            evicted_blocks=0, verify_failures=0, loaded_blocks=0,
                            dropped_at_load=0)
        self._load()
        self._cond = threading.Condition()  # the writer's queue, busy slots, pending copies
        self.writer = SlotWriter(self.file, self._cond, self._busy)
        # pool blocks demoted but not yet copied out -> the thread that copies them (settle);
        # written under _cond and the service lock, waited for under _cond
        self._pending: dict[int, int] = {}
        self._local = threading.local()  # .pending: this thread's [(pool block, entry)]
        self.writer.start()

    # ---- start: rebuild the index from the slots ------------------------------------------

    def _load(self) -> None:
        found: dict[Key, tuple[int, SlotMeta]] = {}
        dropped = 0
        for slot, meta in self.file.scan():
            if meta is None:
                dropped += self._was_written(slot)
                continue
            if chain_hash(meta.parent, meta.namespace, meta.tokens) != meta.hash:
                dropped += 1
                continue
            key = (meta.namespace, meta.hash)
            old = found.get(key)
            if old is None or (old[1].generation, old[1].seq) < (meta.generation, meta.seq):
                found[key] = (slot, meta)
        self.index.load(sorted(found.values(), key=lambda f: (f[1].generation, f[1].seq)))
        self._counts["loaded_blocks"] = len(found)
        self._counts["dropped_at_load"] = dropped
        if found or dropped:
            log.info("disk tier %s: %d blocks loaded, %d slots dropped (torn or not verifying)",
                     self.file.path, len(found), dropped)

    def _was_written(self, slot: int) -> int:
        """1 if an unreadable slot holds anything (a torn or corrupt write), 0 if empty."""
        head = os.pread(self.file.fd, 64, self.file.offset(slot))
        return int(bool(head.strip(b"\0")))

    # ---- the hooks ------------------------------------------------------------------------

    def inserted(self, namespace: str, tokens: bytes, block_ids: Sequence[int],
                 result: InsertResult) -> None:
        if not result.adopted:
            return
        first = result.num_cached_tokens // self.block_size
        parent = ZERO_HASH
        if first:
            known = self._mem.get(block_ids[first - 1])
            parent = known.hash if known is not None else self._chain(namespace, tokens, first)
        self._learn(namespace, tokens, first, result.adopted, parent)

    def _chain(self, namespace: str, tokens: bytes, end: int) -> bytes:
        h, bb = ZERO_HASH, self._bb
        for i in range(end):
            h = chain_hash(h, namespace, tokens[i * bb:(i + 1) * bb])
        return h

    def _learn(self, namespace: str, tokens: bytes, first: int, ids: Sequence[int],
               parent: bytes) -> None:
        """Keys for pool blocks `ids` holding blocks first, first+1, ... of `tokens`; a copy of
        one of them on disk is dropped (a block is in one tier)."""
        bb = self._bb
        for i, b in enumerate(ids, first):
            tok = tokens[i * bb:(i + 1) * bb]
            h = chain_hash(parent, namespace, tok)
            self._mem[b] = BlockKey(namespace, h, parent, i, tok, self.pool.is_sink(b))
            if len(self.index):
                self._free(self.index.drop((namespace, h)))
            parent = h

    def demote(self, namespace: str, block_ids: Sequence[int],
               hashes: Sequence[int | None] = ()) -> None:
        """Under the service lock: each block's entry, its payload pending (copied out of
        the pool by this thread's `settle`)."""
        me, mine = threading.get_ident(), None
        for b, h in zip(block_ids, hashes or [None] * len(block_ids), strict=True):
            key = self._mem.pop(b, None)
            if key is None:
                continue
            self._counts["demoted_blocks"] += 1
            sink = self.pool.is_sink(b)
            entry = self._put(key, self._payload_len[sink], sink, h)
            if entry is not None:
                if mine is None:
                    mine = self._mine()
                entry.pending = b
                mine.append((b, entry))
                with self._cond:
                    self._pending[b] = me

    def _mine(self) -> list[tuple[int, Entry]]:
        mine: list[tuple[int, Entry]] | None = getattr(self._local, "pending", None)
        if mine is None:
            mine = self._local.pending = []
        return mine

    def settle(self) -> None:
        """Off the service lock, on the thread that demoted (radixkv/service/tier.py): its pending
        payloads copied out of the pool into their entries, and their writes queued (waiting
        for the writer when its queue is full). An entry that left the index meanwhile
        (dropped, cleared, evicted for another) is neither copied nor written."""
        mine = getattr(self._local, "pending", None)
        if not mine:
            return
        self._local.pending = []
        try:
            for b, entry in mine:
                payload = self._copy(b) if entry.pending == b else None
                with self._cond:
                    del self._pending[b]  # the block may be handed out again
                    self._cond.notify_all()
                    if payload is not None:
                        self.writer.room()
                        if entry.pending == b:  # (still in the index, its slot its own)
                            entry.staging = payload  # (first: a plan that sees it not
                            entry.pending = None  # pending reads this copy, not the slot)
                            self.writer.append(entry.slot, entry)
        except BaseException:  # the blocks are never waited for again; entries left pending
            with self._cond:  # are misses
                for b, _ in mine:
                    self._pending.pop(b, None)
                self._cond.notify_all()
            raise

    def _copy(self, b: int) -> memoryview:
        """Pool block `b`'s bytes (numpy's copy lets the GIL go: other calls run meanwhile)."""
        copy: memoryview = self.pool.block_bytes(b).copy().data
        return copy

    def claimed(self, block_ids: Sequence[int]) -> None:
        """Under the service lock: pool blocks about to be handed out (to a lease, or to a
        promotion's read) wait for any other thread's copy out of them (its `settle` runs off
        that lock). A thread's own pending blocks are copied before it answers or reads."""
        if not self._pending:
            return
        me = threading.get_ident()
        with self._cond:
            while any(self._pending.get(b, me) != me for b in block_ids):
                self._cond.wait()

    def _put(self, key: BlockKey, payload_len: int, sink: bool,
             event_hash: int | None = None) -> Entry | None:
        """The block's entry, newest in the index, its payload not given yet (the caller's:
        pending, or `_put_now`). None: the writer is failing and the block is dropped."""
        if self.writer.error is not None:  # the writer failed (logged): the block is dropped
            self._counts["evicted_blocks"] += 1
            if event_hash is not None:
                self._dropped.append((key.namespace, event_hash))
            return None
        self._seq += 1
        meta = SlotMeta(key.namespace, key.hash, key.parent, key.position, key.tokens,
                        payload_len, sink and self.pool.num_sink_blocks > 0,
                        self.file.generation, self._seq)
        self._free(self.index.drop((key.namespace, key.hash)))
        entry, evicted = self.index.add(meta, None)
        entry.event_hash = event_hash
        self._counts["evicted_blocks"] += len(evicted)
        self._lost(evicted)
        return entry

    def _put_now(self, key: BlockKey, payload: bytes, sink: bool,
                 event_hash: int | None = None) -> None:
        """`_put` with the payload in hand: its write queued now."""
        entry = self._put(key, len(payload), sink, event_hash)
        if entry is not None:
            entry.staging = payload
            self.writer.enqueue(entry.slot, entry)

    def _lost(self, entries: Sequence[Entry]) -> None:
        """Entries dropped from the tier: the events must say so for those they marked here."""
        self._dropped += [(e.meta.namespace, e.event_hash) for e in entries
                          if e.event_hash is not None]

    def take_dropped(self) -> list[tuple[str, int]]:
        dropped, self._dropped = self._dropped, []
        return dropped

    def promoting(self, namespace: str) -> bool:
        return namespace in self._promoting

    def _free(self, entry: Entry | None) -> None:
        """A slot left the index: its header is zeroed (queued), so a restart does not bring
        back a block that was promoted, dropped or cleared. (A crash before that write lands
        brings it back: its bytes are still that prefix's KV.)"""
        if entry is not None:
            self.writer.enqueue(entry.slot, None)

    def sync_drops(self) -> None:
        """Off the service lock: every write queued so far (a Clear's tombstones) done and
        fsynced; Unavailable if the writer keeps failing or the fsync fails."""
        self.writer.sync()

    def cleared(self, namespace: str, block_ids: Sequence[int]) -> int:
        for b in block_ids:
            self._mem.pop(b, None)
        dropped = self.index.drop_namespace(namespace)
        for entry in dropped:
            entry.staging = None  # a write still queued is skipped: its tombstone follows
            self._free(entry)
        return len(dropped)

    def flush(self) -> None:
        """Wait until every demotion is copied out and every queued write is done, then
        fsync."""
        self.settle()
        with self._cond:
            w = self.writer
            while (self._pending or w.queue or w.writing) and w.error is None:
                self._cond.wait(1.0)
        self.file.sync()

    # ---- figures, invariants, stop ------------------------------------------------------------

    def stats(self) -> DiskStats:
        return DiskStats(
            capacity_blocks=self.index.capacity, blocks=len(self.index),
            bytes=self.index.payload_bytes,
            slot_bytes=self.file.geometry.slot_bytes,
            pending_writes=self.writer.queued - self.writer.done + len(self._pending),
            generation=self.file.generation,
            state="ok" if self.writer.error is None else "failing",
            last_error=self.writer.last_error, write_errors=self.writer.errors, **self._counts)

    def check_integrity(self, cached: int) -> None:
        problem = self.index.check()
        if problem is None and len(self._mem) != cached:
            problem = f"{len(self._mem)} pool blocks have disk keys, {cached} are cached"
        if problem is None:
            on_disk = {(k.namespace, k.hash) for k in self._mem.values()}
            if any(key in self.index for key in on_disk):
                problem = "a block is cached in the pool and on disk"
        if problem is None:
            problem = self._format_problem()
        if problem is not None:
            raise IntegrityError(problem)

    def _format_problem(self) -> str | None:
        """None, or a pool block (cached or reserved) holding bytes of the other format: a
        regular block's bytes in a sink block would read another prompt's sink tokens."""
        held = [(b, k.sink) for b, k in self._mem.items()] + list(self._reserved.items())
        for b, sink in held:
            if sink != self.pool.is_sink(b):
                return (f"pool block {b} is a {'sink' if self.pool.is_sink(b) else 'regular'} "
                        f"block holding a {'sink' if sink else 'regular'}-format block")
        return None

    def close(self, write_down: bool) -> None:
        self.settle()
        with self._cond:  # other calls' copies out of the pool, queued
            while self._pending:
                self._cond.wait()
        if write_down:  # children first: on disk they are older than their parents
            for b, key in sorted(self._mem.items(), key=lambda kv: -kv[1].position):
                self._put_now(key, bytes(self.pool.block_bytes(b).data), self.pool.is_sink(b))
            log.info("disk tier: %d cached pool blocks written down", len(self._mem))
        self.writer.stop()
        self._checkers.shutdown()
        try:
            self.file.sync()
        except OSError as e:
            log.error("disk tier: the final fsync failed: %s", e)
        self.file.close()
