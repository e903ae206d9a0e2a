"""Promotion: a Match whose prompt continues into the disk tier brings those blocks up.

The contract: a Match whose prompt continues past the pool's cached prefix into
blocks on disk brings up to `promote_blocks` of them into pool blocks (evicting, so demoting,
as an Allocate would), checks each slot's CRC, inserts them in the tree and only then matches;
the lease pins them like any hit, so an engine never reads a block whose promotion has not
completed. A slot that fails its check is dropped and counted (`verify_failures`): the Match
stops there, a miss, never wrong KV. The pool blocks, each of its slot's format (sink or
regular), are reserved under the service lock (`plan`, then `reserve` once the service made
room), read into straight from the file off it (`read`: os.preadv, no copy), and put in the
tree under it again (`apply`); while reserved they are in no tree and no lease.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from kvpool.base import BlockPool
from radixkv.disk.index import DiskIndex, Entry
from radixkv.disk.slots import ZERO_HASH, BlockKey, SlotFile, chain_hash
from radixkv.disk.writer import SlotWriter
from radixkv.index.results import InsertResult
from radixkv.service.kinds import Namespace

RUN_SLOTS = 4  # adjacent slots read by one os.preadv at most (4 MiB of 1 MiB blocks)


@dataclass(slots=True, eq=False)
class Promotion:
    """One Match query's blocks on their way up from disk (DiskTier.plan, read, apply)."""

    name: str  # the namespace (Clear of it waits: FailedPrecondition while this is in flight)
    ns: Namespace | None  # None: the namespace had no tree when planned
    tokens: bytes
    cached: int  # blocks of the prompt cached in the pool when planned (pinned by `handle`)
    handle: object
    taken: list[Entry]
    ids: list[int]  # the pool blocks reserved for them, in the same order (`reserve`)
    sinks: int = 0  # how many of them are sink-format blocks (the rest: regular)
    views: list[memoryview] = field(default_factory=list)  # where each payload goes
    good: int = 0  # blocks read and verified, from the first
    failed: bool = False  # the entry after the good ones failed its check
    busy: bool = False  # its slots are marked busy (DiskTier._busy) until its read is done
    live: bool = True  # not yet applied or abandoned (counted in DiskTier._promoting)

    @property
    def regular(self) -> int:
        """Regular-format blocks it needs (`sinks` sink blocks besides)."""
        return len(self.taken) - self.sinks

class Promotions:
    """DiskTier's promotion calls (the tier's state, as DiskTier.__init__ sets it)."""

    pool: BlockPool
    block_size: int
    promote_blocks: int
    file: SlotFile
    index: DiskIndex
    writer: SlotWriter
    _bb: int
    _cond: threading.Condition
    _busy: dict[int, int]
    _reserved: dict[int, bool]
    _promoting: dict[str, int]
    _mem: dict[int, BlockKey]
    _counts: dict[str, int]
    _checkers: ThreadPoolExecutor
    # the tier's own calls these use
    _chain: Callable[[str, bytes, int], bytes]
    _lost: Callable[[Sequence[Entry]], None]
    _put_now: Callable[..., None]
    claimed: Callable[[Sequence[int]], None]
    inserted: Callable[[str, bytes, Sequence[int], InsertResult], None]

    def plan(self, name: str, ns: Namespace | None, tokens: bytes) -> Promotion | None:
        """Under the service lock: the disk entries that continue `tokens`' cached prefix in
        namespace `name` (`ns`, None when it has no tree now; at most promote_blocks), taken
        out of the index (their slots reserved), and that prefix pinned in the tree until
        `apply` or `abandon`. The service then makes room for the plan's `regular` and `sinks`
        blocks (evicting, so demoting, as an Allocate would) and calls `reserve`. None:
        nothing to promote."""
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
        self._promoting[name] = self._promoting.get(name, 0) + 1
        return Promotion(name, ns, tokens, k, handle, found, [], sinks=sinks, busy=True)

    def reserve(self, plan: Promotion) -> None:
        """Under the service lock, once the service made room: a pool block for each planned
        entry, of its slot's format (a sink block for a sink-format payload, its first tokens
        after the quantized part; a regular one for the rest). OutOfBlocks (nothing reserved):
        the service abandons the plan, and the blocks stay on disk."""
        got = self.pool.alloc(len(plan.taken), sinks=plan.sinks, exact=True)
        self.claimed(got)  # (read into off the service lock)
        sink_ids, regular_ids = iter(got[:plan.sinks]), iter(got[plan.sinks:])
        plan.ids = [next(sink_ids if e.meta.sink else regular_ids) for e in plan.taken]
        for entry, b in zip(plan.taken, plan.ids, strict=True):
            block = self.pool.block_bytes(b)
            if entry.meta.payload_len != len(block):  # not this block's format: read no further
                break
            plan.views.append(block.data)
        self._reserved.update((b, e.meta.sink) for b, e in zip(plan.ids, plan.taken, strict=True))

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

    def apply(self, ns: Namespace, plan: Promotion) -> int:
        """Under the service lock again: the verified blocks, already in their reserved pool
        blocks, into the tree (the rest freed), before the Match reads the tree. Returns the
        blocks promoted (the caller publishes the tree's events)."""
        good, ids = plan.good, plan.ids
        self._counts["verify_failures"] += plan.failed
        gone = good + plan.failed  # the promoted ones, and the one that failed its check
        self._tombstone(plan.taken[:gone])
        self._lost(plan.taken[good:gone])
        self._restore(plan.taken[gone:])  # the rest stay on disk
        self._retire(plan)
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
                               [e.meta.sink for e in plan.taken[:good]])
        finally:
            plan.views.clear()
            if plan.ns is not None:
                plan.ns.tree.unlock(plan.handle)

    def abandon(self, plan: Promotion) -> None:
        """A plan not applied (its Match failed): its entries back on disk, its reserved
        blocks free, its pin gone."""
        self._unbusy(plan)
        self._restore(plan.taken)
        self._retire(plan)
        plan.views.clear()
        self.pool.free(plan.ids)
        if plan.ns is not None:
            plan.ns.tree.unlock(plan.handle)

    def _retire(self, plan: Promotion) -> None:
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
                self.writer.enqueue(entry.slot, None)

    def _adopt(self, ns: Namespace, tokens: bytes, ids: Sequence[int],
               sinks: Sequence[bool]) -> int:
        """Promoted blocks `ids` (holding their KV, in the format `sinks` says) for the last
        len(ids) blocks of `tokens` into the tree. An engine may have inserted some of them
        meanwhile: those are duplicates, freed."""
        n = len(tokens) // self._bb
        cached = ns.tree.match(tokens).block_ids
        given = [*cached[:n - len(ids)], *ids]
        result = ns.tree.insert(tokens, given)
        if result.duplicates:
            self.pool.free(list(result.duplicates))
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
