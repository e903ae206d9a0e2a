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

Promote (the contract): a Match whose prompt continues past the pool's cached prefix into
blocks on disk brings up to `promote_blocks` of them into pool blocks (evicting, so demoting,
as an Allocate would), checks each slot's CRC, inserts them in the tree and only then matches;
the lease pins them like any hit, so an engine never reads a block whose promotion has not
completed. A slot that fails its check is dropped and counted (`verify_failures`): the Match
stops there, a miss, never wrong KV. The pool blocks, each of its slot's format (sink or
regular), are reserved under the service lock (`plan`), read into straight from the file off
it (`read`: os.preadv, no copy), and put in the tree under it again (`apply`); while reserved
they are in no tree and no lease.

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

import dataclasses
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from gpu_pool.base import BlockPool
from radixkv.disk.index import DiskIndex, Entry, Key
from radixkv.disk.slots import FILE_NAME, ZERO_HASH, SlotFile, SlotMeta, chain_hash
from radixkv.index.results import InsertResult
from radixkv.protocol.errors import IntegrityError, OutOfBlocks, Unavailable
from radixkv.protocol.tokens import block_bytes
from radixkv.protocol.values import DiskStats
from radixkv.service.kinds import Namespace
from radixkv.service.tier import MakeRoom, NoTier, Publish

log = logging.getLogger("radixkv.disk")

WRITE_BATCH = 64  # slots per writer pass
MAX_PENDING = 1024  # queued demotions before a demotion waits for the writer
CHECKERS = 2  # threads checking the checksums of blocks read (xxhash releases the GIL)
RUN_SLOTS = 4  # adjacent slots read by one os.preadv at most (4 MiB of 1 MiB blocks)
RETRY_FIRST_S, RETRY_MAX_S = 0.05, 2.0  # a failed write's backoff: doubled up to the cap
STOP_ATTEMPTS = 3  # a stopping tier's tries of a failing write before it gives up
SYNC_FAILING_S = 5.0  # how long sync_drops waits on a failing writer before Unavailable


@dataclass(slots=True, eq=False)
class Promotion:
    """One Match query's blocks on their way up from disk (DiskTier.plan, read, apply)."""

    name: str  # the namespace (Clear of it waits: FailedPrecondition while this is in flight)
    ns: Namespace | None  # None: the namespace had no tree when planned
    tokens: bytes
    cached: int  # blocks of the prompt cached in the pool when planned (pinned by `handle`)
    handle: object
    taken: list[Entry]
    ids: list[int]  # the pool blocks reserved for them, in the same order
    views: list[memoryview] = field(default_factory=list)  # where each payload goes
    good: int = 0  # blocks read and verified, from the first
    failed: bool = False  # the entry after the good ones failed its check
    busy: bool = False  # its slots are marked busy (DiskTier._busy) until its read is done
    live: bool = True  # not yet applied or abandoned (counted in DiskTier._promoting)

@dataclass(frozen=True, slots=True)
class BlockKey:
    """What the tier knows of a pool block: enough to write its slot."""

    namespace: str
    hash: bytes
    parent: bytes
    position: int
    tokens: bytes
    sink: bool  # its bytes are in the sink format (a promoted block: its slot's format)


class DiskTier(NoTier):
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
                            dropped_at_load=0, write_errors=0)
        self._load()
        self._queue: deque[tuple[int, Entry | None]] = deque()  # (slot, entry | tombstone)
        self._cond = threading.Condition()
        self._stop = False
        self._writing = False  # the writer holds a batch it has not written yet
        self._error: BaseException | None = None  # the last write failed (it is retried)
        self._last_error = ""  # the last write or fsync error, kept after a recovery
        self._queued = self._done = 0  # writes queued, and written (or skipped), so far
        # pool blocks demoted but not yet copied out -> the thread that copies them (settle);
        # written under _cond and the service lock, waited for under _cond
        self._pending: dict[int, int] = {}
        self._local = threading.local()  # .pending: this thread's [(pool block, entry)]
        self._writer = threading.Thread(target=self._write_loop, name="disk-writer", daemon=True)
        self._writer.start()

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
        for the writer when MAX_PENDING are queued). An entry that left the index meanwhile
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
                        self._room()
                        if entry.pending == b:  # (still in the index, its slot its own)
                            entry.staging = payload  # (first: a plan that sees it not
                            entry.pending = None  # pending reads this copy, not the slot)
                            self._append(entry.slot, entry)
        finally:  # (the blocks are never waited for again; entries left pending are misses)
            with self._cond:
                for b, _ in mine:
                    self._pending.pop(b, None)
                self._cond.notify_all()

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
        if self._error is not None:  # the writer failed (logged): the block is dropped
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
            self._enqueue(entry.slot, entry)

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
            self._enqueue(entry.slot, None)

    def _enqueue(self, slot: int, entry: Entry | None) -> None:
        with self._cond:
            self._room()
            self._append(slot, entry)

    def _room(self) -> None:
        """Under _cond: wait while MAX_PENDING writes are queued (not while a promotion reads:
        the writer may be waiting for its slots, and the promotion's own evictions come here
        before its read)."""
        while len(self._queue) >= MAX_PENDING and not self._busy and self._error is None:
            self._cond.wait(1.0)

    def _append(self, slot: int, entry: Entry | None) -> None:
        self._queue.append((slot, entry))
        self._queued += 1
        self._cond.notify_all()

    def cleared(self, namespace: str, block_ids: Sequence[int]) -> int:
        for b in block_ids:
            self._mem.pop(b, None)
        dropped = self.index.drop_namespace(namespace)
        for entry in dropped:
            entry.staging = None  # a write still queued is skipped: its tombstone follows
            self._free(entry)
        return len(dropped)

    def sync_drops(self) -> None:
        """Off the service lock: wait until every write queued so far (a Clear's tombstones)
        is done and fsynced. Unavailable if the writer keeps failing or the fsync fails."""
        with self._cond:
            mark, give_up = self._queued, None
            while self._done < mark:
                if self._error is None:
                    give_up = None
                elif give_up is None:
                    give_up = time.monotonic() + SYNC_FAILING_S
                elif time.monotonic() >= give_up:
                    raise Unavailable(self._not_durable(self._error))
                self._cond.wait(0.05)
        try:
            self.file.sync()
        except OSError as e:
            self._note_error(e, failing=False)  # (nothing to retry: the next write says)
            raise Unavailable(self._not_durable(e)) from None

    @staticmethod
    def _not_durable(e: BaseException) -> str:
        return (f"cleared in memory and in the disk index, but the disk tier cannot write "
                f"({e}): a crash before its writes succeed may bring those blocks back")

    def plan(self, name: str, ns: Namespace | None, tokens: bytes,
             make_room: MakeRoom) -> Promotion | None:
        """Under the service lock: the disk entries that continue `tokens`' cached prefix in
        namespace `name` (`ns`, None when it has no tree now; at most promote_blocks), taken
        out of the index (their slots reserved), pool blocks reserved for them (`make_room`
        evicts, so demotes, as an Allocate would; none when the pool has no room), and that
        prefix pinned in the tree until `apply` or `abandon`. None: nothing to promote."""
        if not self.index.has_namespace(name):
            return None
        bb, k, handle, parent = self._bb, 0, None, ZERO_HASH
        if ns is not None:
            m = ns.tree.match(tokens)
            k, handle = len(m.block_ids), m.handle
            if k:
                known = self._mem.get(m.block_ids[-1])
                parent = known.hash if known is not None else self._chain(name, tokens, k)
        found: list[Entry] = []
        for i in range(k, min(len(tokens) // bb, k + self.promote_blocks)):
            tok = tokens[i * bb:(i + 1) * bb]
            h = chain_hash(parent, name, tok)
            entry = self.index.get((name, h))
            if entry is None or entry.meta.tokens != tok or entry.pending is not None:
                break  # (pending: its bytes are not copied out of the pool yet)
            found.append(entry)
            parent = h
        if not found:
            return None
        self._mark_busy(found)  # no write touches their slots until they are read
        for entry in found:  # their slots free: the blocks evicted to make room may take them
            self.index.drop((name, entry.meta.hash))
        if ns is not None:  # nothing may evict the prefix they extend meanwhile
            ns.tree.lock(handle, hit=False)
        sinks = sum(e.meta.sink for e in found)  # each block into a pool block of its format
        try:
            make_room(len(found) - sinks, sinks)
            ids = self._alloc(found, sinks)
        except OutOfBlocks:  # all pinned: the blocks stay on disk, this Match misses them
            self._restore(found)
            self._unmark_busy(found)
            if ns is not None:
                ns.tree.unlock(handle)
            return None
        plan = Promotion(name, ns, tokens, k, handle, found, ids, busy=True)
        for entry, b in zip(found, ids, strict=True):
            block = self.pool.block_bytes(b)
            if entry.meta.payload_len != len(block):  # not this block's format: read no further
                break
            plan.views.append(block.data)
        self._reserved.update((b, e.meta.sink) for b, e in zip(ids, found, strict=True))
        self._promoting[name] = self._promoting.get(name, 0) + 1
        return plan

    def _alloc(self, entries: Sequence[Entry], sinks: int) -> list[int]:
        """A pool block for each entry, of its slot's format: a sink block for a sink-format
        payload (its first tokens after the quantized part), a regular one for the rest."""
        got = self.pool.alloc(len(entries), sinks=sinks, exact=True)
        self.claimed(got)  # (read into off the service lock)
        sink_ids, regular_ids = iter(got[:sinks]), iter(got[sinks:])
        return [next(sink_ids if e.meta.sink else regular_ids) for e in entries]

    def read(self, plans: Sequence[Promotion]) -> None:
        """Off the service lock: each plan's payloads read straight into its reserved pool
        blocks and checked; `good` counts those that verify, up to the first that fails.
        This thread reads runs of adjacent slots (up to RUN_SLOTS, one os.preadv each) in slot
        order, one after another: one sequential stream, which the kernel's readahead
        follows (reader threads taking runs in turn defeat it: it measured slower), while
        CHECKERS threads check the CRCs of the runs already read."""
        checks: list[tuple[Promotion, list[int], Future[list[bool]] | None]] = []
        try:
            for p in plans:
                for run in self._runs(p):
                    checks.append((p, run, self._read_run(p, run)))
            verified = [[True] * len(run) if f is None else f.result() for _, run, f in checks]
        except BaseException:  # no checker left reading blocks the caller is about to free
            wait([f for _, _, f in checks if f is not None])
            raise
        finally:
            for p in plans:
                self._unbusy(p)
        for p in plans:  # (a run is in slot order, often the reverse of the prompt's)
            bad = [i for (q, run, _), oks in zip(checks, verified, strict=True) if q is p
                   for i, ok in zip(run, oks, strict=True) if not ok]
            p.good = min(bad, default=len(p.views))
            p.failed = p.good < len(p.views)

    def _runs(self, plan: Promotion) -> list[list[int]]:
        """The plan's entries (their places in it) as runs of adjacent slots, in slot order;
        an entry whose write is still queued is a run of its own."""
        order = sorted(range(len(plan.views)), key=lambda i: plan.taken[i].slot)
        runs: list[list[int]] = []
        last, last_alone = -2, False
        for i in order:
            entry = plan.taken[i]
            alone = entry.staging is not None  # (the writer only ever clears it)
            if alone or last_alone or entry.slot != last + 1 or len(runs[-1]) >= RUN_SLOTS:
                runs.append([i])
            else:
                runs[-1].append(i)
            last, last_alone = entry.slot, alone
        return runs

    def _read_run(self, plan: Promotion, run: list[int]) -> Future[list[bool]] | None:
        """Read one run into its pool blocks; the check of each block is queued for a
        checker. None: the run verified already (a queued write's copy)."""
        first = plan.taken[run[0]]
        staging = first.staging
        if staging is not None:  # its write is still queued (a run of one): the copy in memory
            plan.views[run[0]][:] = staging
            return None
        outs = [plan.views[i] for i in run]
        heads, got = self.file.read_run(first.slot, outs)
        return self._checkers.submit(self.file.check_run, heads, got,
                                     [plan.taken[i].meta for i in run], outs)

    def apply(self, ns: Namespace, plan: Promotion, publish: Publish) -> int:
        """Under the service lock again: the verified blocks, already in their reserved pool
        blocks, into the tree (the rest freed), before the Match reads the tree. Returns the
        blocks promoted."""
        good, ids = plan.good, plan.ids
        self._counts["verify_failures"] += plan.failed
        gone = good + plan.failed  # the promoted ones, and the one that failed its check
        self._tombstone(plan.taken[:gone])
        self._lost(plan.taken[good:gone])
        self._restore(plan.taken[gone:])  # the rest stay on disk
        self._settle(plan)
        try:
            if plan.ns is not None and ns is not plan.ns:  # dropped and made again: to disk
                for entry, b in zip(plan.taken[:good], ids, strict=False):
                    self._requeue(entry, bytes(self.pool.block_bytes(b).data))
                good = 0
            if good < len(ids):
                self.pool.free(ids[good:])
            if not good:
                return 0
            return self._adopt(ns, plan.tokens[:(plan.cached + good) * self._bb], ids[:good],
                               [e.meta.sink for e in plan.taken[:good]], publish)
        finally:
            plan.views.clear()
            if plan.ns is not None:
                plan.ns.tree.unlock(plan.handle)

    def abandon(self, plan: Promotion) -> None:
        """A plan not applied (its Match failed): its entries back on disk, its reserved
        blocks free, its pin gone."""
        self._unbusy(plan)
        self._restore(plan.taken)
        self._settle(plan)
        plan.views.clear()
        self.pool.free(plan.ids)
        if plan.ns is not None:
            plan.ns.tree.unlock(plan.handle)

    def _settle(self, plan: Promotion) -> None:
        """The plan is applied or abandoned (once): its blocks are no longer reserved."""
        if plan.live:
            plan.live = False
            for b in plan.ids:
                del self._reserved[b]
            left = self._promoting[plan.name] - 1
            if left:
                self._promoting[plan.name] = left
            else:
                del self._promoting[plan.name]

    @property
    def reserved_blocks(self) -> int:
        return len(self._reserved)

    def _mark_busy(self, entries: Sequence[Entry]) -> None:
        with self._cond:
            for e in entries:
                self._busy[e.slot] = self._busy.get(e.slot, 0) + 1

    def _unmark_busy(self, entries: Sequence[Entry]) -> None:
        with self._cond:
            for e in entries:
                left = self._busy[e.slot] - 1
                if left:
                    self._busy[e.slot] = left
                else:
                    del self._busy[e.slot]
            self._cond.notify_all()

    def _unbusy(self, plan: Promotion) -> None:
        """The plan's slots may be written again (once: read and abandon both call this)."""
        if plan.busy:
            plan.busy = False
            self._unmark_busy(plan.taken)

    def _restore(self, entries: Sequence[Entry]) -> None:
        """Planned entries back in the index, each whose slot no demotion took meanwhile
        (the others are gone: counted as evicted)."""
        for entry in entries:
            if not self.index.put_back(entry):
                self._counts["evicted_blocks"] += 1
                self._lost([entry])

    def _tombstone(self, entries: Sequence[Entry]) -> None:
        """Promoted entries' slots, if still free, get a zeroed header (see `_free`)."""
        for entry in entries:
            if self.index.is_free(entry.slot):
                self._enqueue(entry.slot, None)

    def _adopt(self, ns: Namespace, tokens: bytes, ids: Sequence[int], sinks: Sequence[bool],
               publish: Publish) -> int:
        """Promoted blocks `ids` (holding their KV, in the format `sinks` says) for the last
        len(ids) blocks of `tokens` into the tree. An engine may have inserted some of them
        meanwhile: those are duplicates, freed."""
        n = len(tokens) // self._bb
        cached = ns.tree.match(tokens).block_ids
        given = [*cached[:n - len(ids)], *ids]
        result = ns.tree.insert(tokens, given)
        if result.duplicates:
            self.pool.free(list(result.duplicates))
        publish(ns.name)
        self.inserted(ns.name, tokens, given, result)
        for b, sink in zip(ids, sinks, strict=True):  # what its bytes are: the slot's format
            key = self._mem.get(b)
            if key is not None and key.sink != sink:
                self._mem[b] = dataclasses.replace(key, sink=sink)
        self._counts["promoted_blocks"] += len(result.adopted)
        self._counts["hit_tokens"] += len(result.adopted) * self.block_size
        return len(result.adopted)

    def _requeue(self, entry: Entry, payload: bytes) -> None:
        meta = entry.meta
        key = BlockKey(meta.namespace, meta.hash, meta.parent, meta.position, meta.tokens,
                       meta.sink)
        self._put_now(key, payload, meta.sink, entry.event_hash)

    # ---- the writer ---------------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait()
                if not self._queue:
                    return
                batch = [self._queue.popleft() for _ in range(min(WRITE_BATCH, len(self._queue)))]
                self._writing = True
                self._cond.notify_all()
            if not self._write_batch(batch):
                return
            for _, entry in batch:
                if entry is not None:
                    entry.staging = None
            with self._cond:
                self._writing = False
                self._done += len(batch)
                self._cond.notify_all()

    def _write_batch(self, batch: list[tuple[int, Entry | None]]) -> bool:
        """Write one batch, retrying with backoff while it fails; False: the tier is stopping
        with the disk still failing (what is queued is lost, logged)."""
        backoff, failures = RETRY_FIRST_S, 0
        while True:
            with self._cond:
                slots = {slot for slot, _ in batch}
                while any(slot in self._busy for slot in slots):  # a promotion reads one
                    self._cond.wait()
            jobs: list[tuple[int, bytes, bytes | memoryview] | int] = []
            for slot, entry in batch:
                payload = None if entry is None else entry.staging
                if entry is None:
                    jobs.append(slot)
                elif payload is not None:  # (None: cleared, or dropped, since it was queued)
                    jobs.append((slot, self.file.encode_meta(entry.meta, payload), payload))
            try:
                self.file.write(jobs)
            except Exception as e:  # noqa: BLE001 - a failing disk: retried, reported
                self._note_error(e)
                failures += 1
                with self._cond:
                    if self._stop and failures >= STOP_ATTEMPTS:
                        log.error("disk tier stopping with writes failing: %d queued writes "
                                  "lost (%s)", len(batch) + len(self._queue), e)
                        self._queue.clear()
                        self._writing = False
                        self._cond.notify_all()
                        return False
                    self._cond.wait(backoff)  # (a stop wakes it)
                backoff = min(2 * backoff, RETRY_MAX_S)
                continue
            if self._error is not None:
                log.warning("disk tier writes succeed again after %d errors",
                            self._counts["write_errors"])
                with self._cond:
                    self._error = None
                    self._cond.notify_all()
            return True

    def _note_error(self, e: BaseException, failing: bool = True) -> None:
        """A failed write (`failing`: until a retry succeeds) or fsync, counted and logged."""
        with self._cond:
            if self._error is None:
                log.error("disk tier write failed (retried with backoff; demotions dropped "
                          "meanwhile): %s", e)
            if failing:
                self._error = e
            self._last_error = str(e)
            self._counts["write_errors"] += 1
            self._cond.notify_all()

    def flush(self) -> None:
        """Wait until every demotion is copied out and every queued write is done, then
        fsync."""
        self.settle()
        with self._cond:
            while (self._pending or self._queue or self._writing) and self._error is None:
                self._cond.wait(1.0)
        self.file.sync()

    # ---- figures, invariants, stop ------------------------------------------------------------

    def stats(self) -> DiskStats:
        return DiskStats(
            capacity_blocks=self.index.capacity, blocks=len(self.index),
            bytes=self.index.payload_bytes,
            slot_bytes=self.file.geometry.slot_bytes,
            pending_writes=self._queued - self._done + len(self._pending),
            generation=self.file.generation,
            state="ok" if self._error is None else "failing", last_error=self._last_error,
            **self._counts)

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
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._writer.join()
        self._checkers.shutdown()
        try:
            self.file.sync()
        except OSError as e:
            log.error("disk tier: the final fsync failed: %s", e)
        self.file.close()
