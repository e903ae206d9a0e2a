"""The service core: one block pool, one radix tree per namespace, leases. No gRPC here.

Every pool block is in exactly one state, and `check_integrity()` proves it: free, leased (to a
lease, written by an engine, not yet inserted), cached (in a namespace's tree; pinned while a
lease locks it) or reserved (read into from the tier below during a Match). A request: match
pins the longest cached prefix in a lease, allocate leases blocks (evicting unpinned leaves),
the engine writes KV through its pool mapping, insert adopts the new blocks (duplicates freed),
release unpins. A lease unused for its TTL expires. Every call does all it says or, when it
raises, nothing. All calls take one lock (SettlingLock); a Match's disk reads and the copies of
demoted blocks run off it. Its parts: checks, leases, namespaces and kinds, the allocator, the
tier below the pool, and beside this file the Insert calls (inserts.py) and the read-only ones
(inspection.py).
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from kvpool.base import BlockPool, PoolHandle
from radixkv.index.hints import NO_HINT
from radixkv.index.policies import policy_factory
from radixkv.index.results import MatchResult
from radixkv.protocol.errors import (
    FailedPrecondition,
    NotFound,
    OutOfBlocks,
)
from radixkv.protocol.values import Allocation, LeaseMatch
from radixkv.service.allocator import Reclaimer
from radixkv.service.checks import InputChecks, check_namespace, hint_codes, key_sizes_of
from radixkv.service.config import ServiceConfig
from radixkv.service.events import EventLog
from radixkv.service.inserts import Inserts
from radixkv.service.inspection import Inspection
from radixkv.service.kinds import kind_of
from radixkv.service.leases import Lease, LeaseTable
from radixkv.service.namespaces import Namespaces
from radixkv.service.tier import NoTier, SettlingLock

__all__ = ["KVService", "ServiceConfig"]



class KVService(Inserts, Inspection):
    def __init__(
        self,
        pool: BlockPool,
        config: ServiceConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        tier: NoTier | None = None,
    ) -> None:
        self.pool = pool
        self._tier = tier or NoTier()  # below the pool: radixkv/service/tier.py
        self.config = config or ServiceConfig()
        self.block_size = pool.layout.block_size
        self.events = EventLog(self.block_size, self.config.event_buffer)
        self._clock = clock
        self._started = clock()
        self._lock = SettlingLock(self._tier)  # its release copies out what was demoted
        self._checks = InputChecks(self.config, pool)
        # the namespace kind, once: full attention, or sliding window (blocks have window parts)
        self.kind = kind_of(pool.layout.window_blocks)
        self._namespaces = Namespaces(
            self.kind, self.block_size, pool.layout.window_blocks,
            policy_factory(self.config.policy, pool.num_full_blocks), self.config.max_namespaces)
        self._leases = LeaseTable(clock, self.config)
        self._reclaim = Reclaimer(pool, self._namespaces, self._leases, self.events,
                                  self._tier)
        self._recent: deque[tuple[int, int]] = deque(maxlen=self.config.recent_window)

    def pool_handle(self) -> PoolHandle:
        return self.pool.export()

    @property
    def epoch(self) -> str:
        """The pool's epoch: block ids are valid only in its mapping."""
        return self.pool.epoch

    # ---- the request path --------------------------------------------------------------------

    def match(self, owner: str, namespace: str, tokens: bytes,
              ttl_s: float | None = None, key_size: int = 0,
              client: str | None = None) -> LeaseMatch:
        """Longest cached prefix of `tokens` (block keys of `key_size` bytes each, where not 0)
        in `namespace`; opens a lease that pins it."""
        return self.match_many(owner, [(namespace, tokens)], ttl_s,
                               key_sizes=[key_size] if key_size else None, client=client)[0]

    def match_many(self, owner: str, queries: Sequence[tuple[str, bytes]],
                   ttl_s: float | None = None,
                   store_tokens: Sequence[int] | None = None,
                   key_sizes: Sequence[int] | None = None,
                   client: str | None = None) -> list[LeaseMatch]:
        """Batched match, one lease per query (`ttl_s`: their TTL, None for the default).
        `client`: what the lease limits count the new leases under (None: the client id
        `owner`; the server passes the connection where it can tell them apart). Every
        query and limit is checked before the first lease opens: a failed batch changes
        nothing. With `store_tokens` (one count per query), each query's lease also gets blocks
        for the uncached full blocks among its first store_tokens[i] tokens, allocated once
        every query is matched and pinned; a query that finds no room says so in its
        `alloc_error` and keeps its match (the batch does not fail). `key_sizes`: None or one
        per query, the bytes of each block key where that query gives keys (radixkv.service.keyed),
        0 where it gives tokens."""
        sizes = key_sizes_of(key_sizes, len(queries))
        for (namespace, tokens), key_size in zip(queries, sizes, strict=True):
            check_namespace(namespace)
            self._checks.data(tokens, key_size)
        ttl = self._checks.ttl(ttl_s)
        out = []
        found: list[MatchResult] = []  # the trees' matches, for the stores
        epoch = self.pool.epoch
        key = _client_key(owner, client)
        check = functools.partial(self._check_match_room, key, queries, sizes)
        plans = self._plan_promotions(queries, sizes, check)
        with self._lock:  # (leaving it copies out what the stores demoted: SettlingLock)
            try:
                check()
            except BaseException:
                self._abandon(plans)
                raise
            for (namespace, tokens), key_size, plan in zip(queries, sizes, plans,
                                                            strict=True):
                ns = self._namespaces.open(namespace, key_size)
                lease = self._leases.open(owner, key, ns.name, ttl)
                ns.num_leases += 1
                if plan is not None:  # blocks read from the tier below go in first
                    self._tier.apply(ns, plan)
                    self._publish(ns.name)
                    self.events.publish_dropped(self._tier.take_dropped())
                m = ns.match(lease, tokens)
                answer = ns.answer(lease.lease_id, m, epoch)
                self._recent.append((ns.span(tokens), answer.num_tokens))
                out.append(answer)
                found.append(m)
            if store_tokens is not None:
                out = [self._reclaim.store(o, queries[i][1], store_tokens[i], found[i])
                       for i, o in enumerate(out)]
        return out

    def _check_match_room(self, key: str, queries: Sequence[tuple[str, bytes]],
                          sizes: Sequence[int]) -> None:
        """A Match batch's limits and kinds (under the lock)."""
        names = {name for name, _ in queries}
        self._namespaces.check_room(len([n for n in names if n not in self._namespaces]))
        self._leases.check_room(key, len(queries), names)
        self._namespaces.check_kinds(
            (name, size) for (name, _), size in zip(queries, sizes, strict=True))

    def _plan_promotions(self, queries: Sequence[tuple[str, bytes]], sizes: Sequence[int],
                         check: Callable[[], None]) -> list[Any]:
        """What the tier below the pool has for each token-keyed query, read off the lock
        into pool blocks reserved for it (radixkv/service/tier.py: plan, read; `apply` puts it in
        the tree under the lock, before the Match). `check`: the batch's checks, made first, so a
        batch that fails them evicts nothing to make room. Nothing without a tier."""
        if not self._tier.present:
            return [None] * len(queries)
        with self._lock:  # (leaving it copies out what making room demoted, before the read)
            check()
            plans: list[Any] = []
            try:
                for (name, tokens), size in zip(queries, sizes, strict=True):
                    plans.append(None if size else self._plan_promotion(name, tokens))
            except BaseException:
                self._abandon(plans)
                raise
        if any(p is not None for p in plans):
            try:
                self._tier.read([p for p in plans if p is not None])
            except BaseException:
                with self._lock:
                    self._abandon(plans)
                raise
        return plans

    def _abandon(self, plans: list[Any]) -> None:
        for plan in plans:
            if plan is not None:
                self._tier.abandon(plan)
        self.events.publish_dropped(self._tier.take_dropped())

    def allocate(
        self, owner: str, lease_id: int | None, namespace: str, num_blocks: int,
        ttl_s: float | None = None, starts_sequence: bool = False, num_window_blocks: int = 0,
        key_size: int = 0, client: str | None = None,
    ) -> Allocation:
        """`num_blocks` free blocks leased to `lease_id` (a new lease in `namespace` if None,
        with TTL `ttl_s`), evicting unpinned LRU leaves when the free list is short. When it
        raises (OutOfBlocks, ...), no lease was opened and nothing was evicted (except while
        looking for a free sink block). `starts_sequence`: the first block will hold position
        0, so it comes from the sink region where the pool has one. `num_window_blocks`:
        window parts too (windowed pools; then num_blocks may be 0). `key_size`: a new lease's
        namespace is key-keyed with keys of this size (radixkv.service.keyed). `client`: as for
        match_many."""
        windows, sinks = num_window_blocks, int(starts_sequence)
        self._checks.allocate(num_blocks, windows)
        ttl = self._checks.ttl(ttl_s)
        with self._lock:
            if lease_id:
                lease = self._get_lease(owner, lease_id)
                if namespace:
                    self._leases.check_namespace(lease, namespace)
                num_evicted = self._reclaim.make_room(num_blocks, sinks=sinks, windows=windows)
                self._leases.touch(lease)
            else:
                check_namespace(namespace)
                if key_size:
                    self._checks.keys(b"\0" * key_size, key_size)
                key = _client_key(owner, client)
                self._namespaces.check_room(namespace not in self._namespaces)
                self._leases.check_room(key, 1, (namespace,))
                self._namespaces.check_kinds([(namespace, key_size)])
                ns = self._namespaces.open(namespace, key_size)
                try:
                    num_evicted = self._reclaim.make_room(num_blocks, keep=ns, sinks=sinks,
                                                          windows=windows)
                except OutOfBlocks:
                    self._namespaces.drop_if_empty(ns)
                    raise
                lease = self._leases.open(owner, key, ns.name, ttl)
                ns.num_leases += 1
            ids, wids = self._reclaim.take(lease, num_blocks, sinks, windows)
            return Allocation(lease.lease_id, ids, num_evicted, self.pool.epoch, wids)

    def keep_alive(self, owner: str, lease_ids: Sequence[int],
                   ttl_s: float | None = None) -> float:
        """Renew leases (each for `ttl_s`, else its own TTL) without other work. All are
        checked first. Returns the earliest new expiry, in seconds from now."""
        ttl = self._checks.ttl(ttl_s) if ttl_s else None
        with self._lock:
            leases = [self._get_lease(owner, lid) for lid in dict.fromkeys(lease_ids)]
            for lease in leases:
                lease.ttl_s = ttl or lease.ttl_s
                self._leases.touch(lease)
            return min(lease.ttl_s for lease in leases)

    def release(self, owner: str, lease_ids: Sequence[int],
                hints: Sequence[str | int | None] | None = None) -> int:
        """End leases: unpin, free leased blocks never inserted. `hints`: None or one
        retention hint per lease id, for the end of what that lease pinned (its inserted path,
        else its match). Returns blocks freed."""
        codes = hint_codes(hints, len(lease_ids))
        with self._lock:
            hint_of = dict(zip(lease_ids, codes, strict=True))
            leases = [self._get_lease(owner, lid) for lid in dict.fromkeys(lease_ids)]
            return sum(self._end_lease(lease, hint=hint_of[lease.lease_id]) for lease in leases)

    def clear(self, namespace: str) -> int:
        """Drop every cached block of `namespace` (in the pool and in the tier below) and the
        namespace itself; publishes AllBlocksCleared. FailedPrecondition while a lease pins or
        holds anything in it, or while a Match brings its blocks up from the tier below.
        Returns the pool blocks freed, once the tier below has made the drop durable
        (Unavailable if it cannot: a crash might bring the blocks back)."""
        freed = self._clear(namespace)
        self._tier.sync_drops()  # off the lock: the writer may have a backlog to write first
        return freed

    def _clear(self, namespace: str) -> int:
        with self._lock:
            if self._tier.promoting(namespace):  # (that Match would put them back)
                raise FailedPrecondition(f"namespace {namespace!r} has blocks coming up from "
                                         "the disk tier; try again")
            ns = self._namespaces.get(namespace)
            if ns is None:
                if not self._tier.cleared(namespace, []):  # on disk only, or nowhere
                    raise NotFound(f"namespace {namespace!r} does not exist")
                self.events.publish_cleared(namespace)
                return 0
            freed = ns.evict_all()
            self._tier.cleared(ns.name, freed)
            self.pool.free(freed)
            self._namespaces.drop(ns)
            self.events.publish_cleared(namespace)
            return len(freed)

    def expire_leases(self) -> int:
        """End every lease past its TTL. Returns how many ended."""
        with self._lock:
            stale = self._leases.stale()
            for lease in stale:
                self._end_lease(lease, expired=True)
            return len(stale)

    def close_tier(self, write_down: bool) -> None:
        """Stop the tier below the pool (with `write_down`, after writing the pool's cached
        blocks to it: a clean stop); the service takes no more calls after this."""
        with self._lock:
            self._tier.close(write_down)

    # ---- internals ---------------------------------------------------------------------------

    def _plan_promotion(self, name: str, tokens: bytes) -> Any:
        """Under the lock: the tier's plan for one query, with room made and pool blocks
        reserved for it; None when it has nothing, or when the pool has no room (all pinned:
        the blocks stay below, the Match misses them)."""
        ns = self._namespaces.get(name)
        plan = self._tier.plan(name, ns, tokens)
        if plan is None:
            return None
        try:
            self._reclaim.make_room(plan.regular + plan.sinks, keep=ns, sinks=plan.sinks,
                                    regular=plan.regular)
            self._tier.reserve(plan)
        except BaseException as e:
            self._tier.abandon(plan)
            if isinstance(e, OutOfBlocks):
                return None
            raise
        return plan

    def _publish(self, namespace: str) -> None:
        self.events.publish(namespace, self._namespaces[namespace].tree.take_events())

    def _get_lease(self, owner: str, lease_id: int) -> Lease:
        """The live lease (LeaseTable.get), one past its TTL ended first (LeaseExpired)."""
        if (overdue := self._leases.overdue(lease_id)) is not None:
            self._end_lease(overdue, expired=True)
        return self._leases.get(owner, lease_id)

    def _end_lease(self, lease: Lease, hint: int = NO_HINT, expired: bool = False) -> int:
        """End a lease: the hint on what it pinned, its pins dropped, its leased blocks freed,
        its record gone, its namespace dropped if left empty. Returns the blocks freed."""
        ns = self._namespaces[lease.namespace]
        ns.end_lease(lease, hint)
        freed = list(lease.owned)
        if freed:
            self.pool.free(freed)
        self._leases.end(lease, expired)
        self._namespaces.drop_if_empty(ns)
        return len(freed)

def _client_key(owner: str, client: str | None) -> str:
    """What the lease limits count a client's leases under."""
    return client if client is not None else f"client id {owner!r}"
