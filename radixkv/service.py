"""The service core: one block pool, one radix tree per namespace, leases. No gRPC here.

Every pool block is always in exactly one of three states, and `check_integrity()` proves it:

    free        in the pool's free list
    leased      allocated to a lease, written by an engine, not yet inserted
    cached      owned by a namespace's tree (pinned while a lease has it locked)

A request's life (each step is one call, each renews the lease's TTL):

    match(ns, tokens)         -> lease L pins the longest cached prefix
    allocate(L, n)            -> n blocks leased to L (evicting unpinned LRU leaves if short)
    ...engine writes KV into the blocks through its pool mapping...
    insert(L, ns, tokens, ids)-> new blocks adopted by the tree, duplicates freed; L pins the path
    release(L)                -> unpin; leased blocks never inserted are freed

Insert and release take an optional retention hint per item / lease (`session_end`, `keep`:
radixkv.index.eviction), which the tree gives the request's end node for the policy to use.

A lease not used for its TTL (`lease_ttl_s`, or what Match / Allocate asked for, capped at
`max_lease_ttl_s`) expires (the server's sweeper calls `expire_leases`): its pins are dropped and
its leased blocks freed; a later call naming it gets LeaseExpired. `keep_alive` renews leases
without other work, for an engine whose forward pass outlasts the TTL.

Every call either does all it says or, when it raises, changes nothing: batches (match_many,
insert_many) are validated whole before the first effect; a failed allocate opens no lease.
A namespace lives while it holds blocks or leases; an empty one is dropped (its lifetime
counters stay in the service totals).
All public methods take one lock: the tree and pool are not thread-safe, and the work per call
is microseconds, so finer locking would not pay on CPython.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import secrets
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import numpy as np

from gpu_pool.base import BlockPool, PoolHandle
from radixkv.errors import (
    AlreadyExists,
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
    LeaseExpired,
    LimitExceeded,
    NotFound,
    OutOfBlocks,
    PermissionDenied,
)
from radixkv.events import EventLog
from radixkv.index.eviction import DEFAULT_POLICY, NO_HINT, parse_hint, policy_factory
from radixkv.index.tree import BlockRemoved, InsertResult, NodeView, RadixTree
from radixkv.index.window_tree import HOLE, WindowedRadixTree, WindowMatch
from radixkv.tokens import TOKEN_BYTES, from_token_bytes, num_tokens
from radixkv.types import Allocation, LeaseMatch, WindowLeaseMatch

MAX_NAMESPACE_LEN = 256
# Namespace names: printable ASCII without spaces ("llama3-8b@rev1", "tenant-a/chat:v2").
NAMESPACE_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F))
MIN_LEASE_TTL_S = 1.0  # the shortest TTL a call may ask for (unless the default is shorter)
EXPIRED_MEMORY = 65536  # how many expired lease ids we remember, to tell "expired" from "unknown"


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    lease_ttl_s: float = 30.0
    max_tokens: int = 1 << 20  # per token list
    vocab_size: int | None = None  # when set, token ids must be < vocab_size
    max_namespaces: int = 1024
    max_leases_per_client: int = 4096  # live leases one client_id may hold
    max_lease_ttl_s: float = 3600.0  # the longest TTL a call may ask for
    policy: str = DEFAULT_POLICY
    event_buffer: int = 65536
    recent_window: int = 1000  # requests in the "recent" hit rate

    def __post_init__(self) -> None:
        for name in ("lease_ttl_s", "max_lease_ttl_s", "max_tokens", "max_namespaces",
                     "max_leases_per_client", "recent_window"):
            value = getattr(self, name)
            if not 0 < value < float("inf"):
                raise InvalidArgument(f"ServiceConfig.{name} must be positive, got {value!r}")
        if self.lease_ttl_s > self.max_lease_ttl_s:
            raise InvalidArgument(f"lease ttl {self.lease_ttl_s:g} s exceeds the cap "
                                  f"{self.max_lease_ttl_s:g} s")


@dataclass(frozen=True, slots=True)
class NamespaceStats:
    namespace: str
    cached_blocks: int
    nodes: int
    requests: int
    query_tokens: int
    hit_tokens: int
    evicted_blocks: int


@dataclass(frozen=True, slots=True)
class ServiceStats:
    num_blocks: int
    free_blocks: int
    leased_blocks: int
    cached_blocks: int
    pinned_blocks: int
    live_leases: int
    expired_leases: int
    requests: int
    query_tokens: int
    hit_tokens: int
    recent_requests: int
    recent_query_tokens: int
    recent_hit_tokens: int
    evicted_blocks: int
    uptime_s: float
    namespaces: tuple[NamespaceStats, ...]
    event_sequence: int = 0  # the last event published when these figures were read
    # windowed pools: window parts (num_blocks and the block counts above count full parts)
    window_blocks: int = 0
    free_window_blocks: int = 0
    cached_window_blocks: int = 0


@dataclass(slots=True)
class _Lease:
    lease_id: int
    owner: str
    namespace: str
    expires_at: float
    ttl_s: float
    handles: list[object] = field(default_factory=list)  # tree lock handles
    owned: dict[int, None] = field(default_factory=dict)  # leased block ids, in order


@dataclass(slots=True)
class _Counters:
    """Lifetime request counters (of a namespace, or of the namespaces already dropped)."""

    requests: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    evicted_blocks: int = 0

    def add(self, other: _Counters) -> None:
        self.requests += other.requests
        self.query_tokens += other.query_tokens
        self.hit_tokens += other.hit_tokens
        self.evicted_blocks += other.evicted_blocks


@dataclass(slots=True)
class _Namespace:
    name: str
    tree: RadixTree
    num_leases: int = 0  # live leases in this namespace
    life: _Counters = field(default_factory=_Counters)


def check_namespace(namespace: str) -> None:
    """InvalidArgument unless `namespace` is a valid name: 1-256 printable ASCII characters,
    no spaces."""
    if not namespace:
        raise InvalidArgument("namespace must not be empty")
    if len(namespace) > MAX_NAMESPACE_LEN:
        raise InvalidArgument(f"namespace is {len(namespace)} characters, "
                              f"limit {MAX_NAMESPACE_LEN}")
    if not NAMESPACE_CHARS.issuperset(namespace):
        bad = next(c for c in namespace if c not in NAMESPACE_CHARS)
        raise InvalidArgument(f"namespace {namespace!r} has {bad!r}: names are printable "
                              "ASCII without spaces")


class KVService:
    def __init__(
        self,
        pool: BlockPool,
        config: ServiceConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.config = config or ServiceConfig()
        self.block_size = pool.layout.block_size
        # sliding-window layouts: blocks have a window part, resumes need the last few
        self.window_blocks = pool.layout.window_blocks
        self.events = EventLog(self.block_size, self.config.event_buffer)
        self._clock = clock
        self._started = clock()
        self._lock = threading.RLock()
        self._namespaces: dict[str, _Namespace] = {}
        self._leases: dict[int, _Lease] = {}
        self._expired: OrderedDict[int, None] = OrderedDict()
        self._leases_of_owner: dict[str, int] = {}
        self._retired = _Counters()  # lifetime counters of namespaces already dropped
        self._recent: deque[tuple[int, int]] = deque(maxlen=self.config.recent_window)
        self._num_expired = 0
        self._ticks = itertools.count(1)  # one LRU clock for every namespace's tree
        # one policy state for every namespace's tree: their victims compare
        self._policies = policy_factory(self.config.policy, pool.num_full_blocks)
        # Lease ids: a random start per service life, so ids from an earlier start are unknown.
        self._lease_ids = itertools.count(secrets.randbits(62) + 1)

    # ---- reads -------------------------------------------------------------------------------

    def pool_handle(self) -> PoolHandle:
        return self.pool.export()

    # ---- the request path --------------------------------------------------------------------

    def match(self, owner: str, namespace: str, tokens: bytes,
              ttl_s: float | None = None) -> LeaseMatch:
        """Longest cached prefix of `tokens` in `namespace`; opens a lease that pins it."""
        return self.match_many(owner, [(namespace, tokens)], ttl_s)[0]

    def match_many(self, owner: str, queries: Sequence[tuple[str, bytes]],
                   ttl_s: float | None = None,
                   store_tokens: Sequence[int] | None = None) -> list[LeaseMatch]:
        """Batched match, one lease per query (`ttl_s`: their TTL, None for the default). Every
        query and limit is checked before the first lease opens: a failed batch changes
        nothing. With `store_tokens` (one count per query), each query's lease also gets blocks
        for the uncached full blocks among its first store_tokens[i] tokens, allocated once
        every query is matched and pinned; a query that finds no room says so in its
        `alloc_error` and keeps its match (the batch does not fail)."""
        for namespace, tokens in queries:
            self._check_namespace(namespace)
            self._check_tokens(tokens)
        ttl = self._ttl(ttl_s)
        out = []
        epoch = self.pool.epoch
        with self._lock:
            new_names = {name for name, _ in queries if name not in self._namespaces}
            self._check_room_for(owner, len(queries), len(new_names))
            full_ends = []  # windowed pools: blocks whose full parts are cached, per query
            for namespace, tokens in queries:
                ns = self._namespace(namespace)
                lease = self._open_lease(owner, ns, ttl)
                m = ns.tree.match(tokens)
                if isinstance(m, WindowMatch):
                    full_ends.append(m.full_tokens // self.block_size)
                if m.num_tokens:
                    ns.tree.lock(m.handle)
                    lease.handles.append(m.handle)
                n = num_tokens(tokens)
                ns.life.requests += 1
                ns.life.query_tokens += n
                ns.life.hit_tokens += m.num_tokens
                self._recent.append((n, m.num_tokens))
                out.append(WindowLeaseMatch(lease.lease_id, m.num_tokens, m.block_ids, epoch,
                                            window_ids=m.window_ids)
                           if isinstance(m, WindowMatch)
                           else LeaseMatch(lease.lease_id, m.num_tokens, m.block_ids, epoch))
            if store_tokens is not None:
                out = [self._allocate_rest(owner, o, queries[i][1], store_tokens[i],
                                           full_ends[i] if full_ends else 0)
                       for i, o in enumerate(out)]
        return out

    def _allocate_rest(self, owner: str, m: LeaseMatch, tokens: bytes,
                       store_tokens: int, full_end: int = 0) -> LeaseMatch:
        """`m` with blocks allocated for the uncached full blocks of tokens[:store_tokens]
        (windowed pools: and the window parts LeaseMatch.new_window_ids describes; `full_end`:
        the blocks whose full parts are cached)."""
        end = min(store_tokens, num_tokens(tokens)) // self.block_size
        want = end - len(m.block_ids)
        if want <= 0:
            return m
        sinks = 0 if m.block_ids else 1  # a sequence's first block comes from the sink region
        need: list[int] = []  # blocks that get window parts
        if self.window_blocks:
            need = self._window_plan(m, tokens, end, full_end)
        windows = len(need)
        try:
            num_evicted = self._make_room(want, sinks=sinks, windows=windows)
        except OutOfBlocks as e:
            return dataclasses.replace(m, alloc_error=str(e))
        lease = self._leases[m.lease_id]
        ids = tuple(self.pool.alloc(want, sinks=sinks))
        wids = tuple(self.pool.alloc_window(windows)) if windows else ()
        lease.owned.update(dict.fromkeys(ids + wids))
        if need:  # aligned to the stored range's last blocks, HOLE where none
            aligned = [HOLE] * (end - need[0])
            for i, w in zip(need, wids, strict=True):
                aligned[i - need[0]] = w
            wids = tuple(aligned)
        if isinstance(m, WindowLeaseMatch):
            return dataclasses.replace(m, new_block_ids=ids, num_evicted=num_evicted,
                                       new_window_ids=wids)
        return LeaseMatch(m.lease_id, m.num_tokens, m.block_ids, m.epoch, ids, num_evicted)

    def _window_plan(self, m: LeaseMatch, tokens: bytes, end: int, full_end: int) -> list[int]:
        """Which of blocks [d, end) a request resumed at d should store window parts of: its
        last window_blocks, and, where the cached full parts reach further than the match (up
        to full_end: a branch point), the window_blocks before full_end that lack theirs."""
        d, wb = len(m.block_ids), self.window_blocks
        need = set(range(max(d, end - wb), end))
        branch = min(full_end, end)
        if branch > d:
            need.update(range(max(d, branch - wb), branch))
            tree = self._namespaces[self._leases[m.lease_id].namespace].tree
            assert isinstance(tree, WindowedRadixTree)
            have = tree.window_parts(tokens)
            need = {i for i in need if i >= full_end or have[i] == HOLE}
        return sorted(need)

    def allocate(
        self, owner: str, lease_id: int | None, namespace: str, num_blocks: int,
        ttl_s: float | None = None, starts_sequence: bool = False, num_window_blocks: int = 0,
    ) -> Allocation:
        """`num_blocks` free blocks leased to `lease_id` (a new lease in `namespace` if None,
        with TTL `ttl_s`), evicting unpinned LRU leaves when the free list is short. When it
        raises (OutOfBlocks, ...), no lease was opened and nothing was evicted (except while
        looking for a free sink block). `starts_sequence`: the first block will hold position
        0, so it comes from the sink region where the pool has one. `num_window_blocks`:
        window parts too (windowed pools; then num_blocks may be 0)."""
        windows = num_window_blocks
        if windows and not self.window_blocks:
            raise InvalidArgument("window parts asked of a pool without a sliding window")
        if not 0 <= windows <= self.pool.num_window_blocks:
            raise InvalidArgument(f"num_window_blocks must be in 0.."
                                  f"{self.pool.num_window_blocks}, got {windows}")
        if not (0 if windows else 1) <= num_blocks <= self.pool.num_full_blocks:
            raise InvalidArgument(
                f"num_blocks must be in 1..{self.pool.num_full_blocks}, got {num_blocks}")
        ttl = self._ttl(ttl_s)
        with self._lock:
            if lease_id:
                lease = self._get_lease(owner, lease_id)
                if namespace and namespace != lease.namespace:
                    raise PermissionDenied(f"lease {lease_id} belongs to namespace "
                                           f"{lease.namespace!r}, not {namespace!r}")
                num_evicted = self._make_room(num_blocks, sinks=int(starts_sequence),
                                              windows=windows)
                self._touch(lease)
            else:
                self._check_namespace(namespace)
                self._check_room_for(owner, 1, namespace not in self._namespaces)
                ns = self._namespace(namespace)
                try:
                    num_evicted = self._make_room(num_blocks, keep=ns,
                                                  sinks=int(starts_sequence), windows=windows)
                except OutOfBlocks:
                    self._drop_if_empty(ns)
                    raise
                lease = self._open_lease(owner, ns, ttl)
            ids = self.pool.alloc(num_blocks, sinks=int(starts_sequence)) if num_blocks else []
            wids = self.pool.alloc_window(windows) if windows else []
            lease.owned.update(dict.fromkeys(ids + wids))
            return Allocation(lease.lease_id, tuple(ids), num_evicted, self.pool.epoch,
                              tuple(wids))

    def insert(
        self, owner: str, lease_id: int, namespace: str, tokens: bytes, block_ids: Sequence[int],
        hint: str | int | None = None, window_ids: Sequence[int] = (),
    ) -> InsertResult:
        """Commit `block_ids` (one per full block of `tokens`) into the namespace's tree. Each
        id must be leased to `lease_id` or be the id the tree already holds at that position.
        Prefixes already cached are not adopted: those leased blocks return to the free list.
        `hint`: a retention hint for the node where `tokens` end (RadixTree.hint).
        `window_ids` (windowed pools): the window parts of the last len(window_ids) blocks,
        each leased to the lease or the one cached there."""
        return self.insert_many(owner, [(lease_id, namespace, tokens, block_ids)],
                                hints=[hint], window_ids=[window_ids])[0][0]

    def insert_many(
        self, owner: str, items: Sequence[tuple[int, str, bytes, Sequence[int]]],
        release: Collection[int] = (), hints: Sequence[str | int | None] | None = None,
        window_ids: Sequence[Sequence[int]] | None = None,
    ) -> tuple[list[InsertResult], dict[int, int]]:
        """`insert` for each (lease_id, namespace, tokens, block_ids), all or nothing: every
        item is checked against the state before the first one is applied, and a block id may
        be claimed by one item only. Then the leases in `release` (ids of these items) end as
        `release` ends them. `hints`: None or one retention hint per item; `window_ids`: None
        or each item's window parts (`insert`). Returns the results and {released lease id:
        blocks freed}."""
        codes = self._hints(hints, len(items))
        wins: Sequence[Sequence[int]] = window_ids or [()] * len(items)
        if len(wins) != len(items):
            raise InvalidArgument(f"{len(wins)} window-part lists for {len(items)} items")
        for (_, namespace, tokens, block_ids), w in zip(items, wins, strict=True):
            self._check_namespace(namespace)
            self._check_insert(tokens, block_ids, w)
        with self._lock:
            leases = [self._get_lease(owner, lease_id) for lease_id, *_ in items]
            claimed: set[int] = set()
            for lease, (_, namespace, tokens, block_ids), w in zip(leases, items, wins,
                                                                  strict=True):
                self._check_claims(lease, namespace, tokens, block_ids, claimed)
                if w:
                    self._check_window_claims(lease, tokens, w, claimed)
            if not {lease.lease_id for lease in leases}.issuperset(release):
                raise InvalidArgument("an insert can only release the leases of its items")
            ending = set(release)
            results = [self._apply_insert(lease, tokens, block_ids,
                                          pin=lease.lease_id not in ending, hint=code,
                                          window_ids=w)
                       for lease, (_, _, tokens, block_ids), code, w
                       in zip(leases, items, codes, wins, strict=True)]
            freed = {lid: self._end_lease(self._leases[lid]) for lid in dict.fromkeys(release)}
            return results, freed

    def keep_alive(self, owner: str, lease_ids: Sequence[int],
                   ttl_s: float | None = None) -> float:
        """Renew leases (each for `ttl_s`, else its own TTL) without other work. All are
        checked first. Returns the earliest new expiry, in seconds from now."""
        ttl = self._ttl(ttl_s) if ttl_s else None
        with self._lock:
            leases = [self._get_lease(owner, lid) for lid in dict.fromkeys(lease_ids)]
            for lease in leases:
                lease.ttl_s = ttl or lease.ttl_s
                self._touch(lease)
            return min(lease.ttl_s for lease in leases)

    def release(self, owner: str, lease_ids: Sequence[int],
                hints: Sequence[str | int | None] | None = None) -> int:
        """End leases: unpin, free leased blocks never inserted. `hints`: None or one
        retention hint per lease id, for the end of what that lease pinned (its inserted path,
        else its match). Returns blocks freed."""
        codes = self._hints(hints, len(lease_ids))
        with self._lock:
            hint_of = dict(zip(lease_ids, codes, strict=True))
            leases = [self._get_lease(owner, lid) for lid in dict.fromkeys(lease_ids)]
            return sum(self._end_lease(lease, hint=hint_of[lease.lease_id]) for lease in leases)

    def clear(self, namespace: str) -> int:
        """Drop every cached block of `namespace` and the namespace itself; publishes
        AllBlocksCleared. FailedPrecondition while a lease pins or holds anything in it."""
        with self._lock:
            ns = self._namespaces.get(namespace)
            if ns is None:
                raise NotFound(f"namespace {namespace!r} does not exist")
            if ns.num_leases:
                raise FailedPrecondition(
                    f"namespace {namespace!r} has {ns.num_leases} live lease(s) "
                    f"({ns.tree.num_locked_blocks} blocks pinned); release them first")
            freed = ns.tree.evict(ns.tree.num_cached_blocks)
            ns.tree.take_events()
            self.pool.free(freed)
            self._drop_namespace(ns)
            self.events.publish_cleared(namespace)
            return len(freed)

    def expire_leases(self) -> int:
        """End every lease past its TTL. Returns how many ended."""
        with self._lock:
            now = self._clock()
            stale = [lease for lease in self._leases.values() if lease.expires_at <= now]
            for lease in stale:
                self._end_lease(lease, expired=True)
            return len(stale)

    # ---- inspection --------------------------------------------------------------------------

    def stats(self) -> ServiceStats:
        with self._lock:
            spaces = tuple(
                NamespaceStats(ns.name, ns.tree.num_cached_blocks, ns.tree.stats().num_nodes,
                               ns.life.requests, ns.life.query_tokens, ns.life.hit_tokens,
                               ns.life.evicted_blocks)
                for ns in sorted(self._namespaces.values(), key=lambda n: n.name))
            life = _Counters()  # namespaces dropped earlier still count
            life.add(self._retired)
            for ns in self._namespaces.values():
                life.add(ns.life)
            cached = sum(ns.tree.num_cached_blocks for ns in self._namespaces.values())
            pinned = sum(ns.tree.num_locked_blocks for ns in self._namespaces.values())
            return ServiceStats(
                event_sequence=self.events.last_sequence,
                num_blocks=self.pool.num_full_blocks,
                free_blocks=self.pool.num_free,
                leased_blocks=self._leased_blocks(),
                cached_blocks=cached,
                pinned_blocks=pinned,
                live_leases=len(self._leases),
                expired_leases=self._num_expired,
                requests=life.requests,
                query_tokens=life.query_tokens,
                hit_tokens=life.hit_tokens,
                recent_requests=len(self._recent),
                recent_query_tokens=sum(q for q, _ in self._recent),
                recent_hit_tokens=sum(h for _, h in self._recent),
                evicted_blocks=life.evicted_blocks,
                uptime_s=self._clock() - self._started,
                namespaces=spaces,
                window_blocks=self.pool.num_window_blocks,
                free_window_blocks=self.pool.num_free_window,
                cached_window_blocks=self._cached_windows(),
            )

    def dump_tree(self, namespace: str, max_depth: int = 0) -> tuple[list[NodeView], int]:
        """A snapshot of one namespace's tree (DFS pre-order, at most `max_depth` edges deep
        when > 0) and the last event sequence number it reflects."""
        with self._lock:
            if namespace not in self._namespaces:
                raise NotFound(f"namespace {namespace!r} does not exist (known: "
                               f"{', '.join(sorted(self._namespaces)) or 'none'})")
            nodes = list(self._namespaces[namespace].tree.nodes())
            if max_depth:
                depth: dict[int | None, int] = {None: 0}
                kept = []
                for node in nodes:
                    depth[node.node_id] = depth[node.parent_id] + 1
                    if depth[node.node_id] <= max_depth:
                        kept.append(node)
                nodes = kept
            return nodes, self.events.last_sequence

    def namespaces(self) -> list[str]:
        with self._lock:
            return sorted(self._namespaces)

    def check_integrity(self) -> None:
        """free + leased + cached == total, and each part's own invariants; IntegrityError
        naming the first that fails (real checks: they hold under `python -O` too)."""
        with self._lock:
            self.pool.check_integrity()
            for ns in self._namespaces.values():
                ns.tree.check_integrity()
            owners = Counter(b for lease in self._leases.values() for b in lease.owned)
            if owners and max(owners.values()) > 1:
                b = owners.most_common(1)[0][0]
                raise IntegrityError(f"block {b} is leased to {owners[b]} leases")
            leased = owners.total()  # each leased block counted once (checked just above)
            cached = sum(ns.tree.num_cached_blocks for ns in self._namespaces.values())
            cached += self._cached_windows()  # window parts: ids of the same pool
            free = self.pool.num_free + self.pool.num_free_window
            total = free + leased + cached
            if total != self.pool.num_blocks:
                raise IntegrityError(
                    f"free {free} + leased {leased} + cached {cached} = {total} "
                    f"!= {self.pool.num_blocks} blocks")
            by_ns = Counter(lease.namespace for lease in self._leases.values())
            by_owner = Counter(lease.owner for lease in self._leases.values())
            if by_owner != Counter(self._leases_of_owner) or any(
                    by_ns[ns.name] != ns.num_leases for ns in self._namespaces.values()):
                raise IntegrityError("per-client or per-namespace lease counts are off")
            if any(name not in self._namespaces for name in by_ns):
                raise IntegrityError("a live lease names a namespace that was dropped")

    # ---- internals ---------------------------------------------------------------------------

    def _check_namespace(self, namespace: str) -> None:
        check_namespace(namespace)

    def _ttl(self, ttl_s: float | None) -> float:
        """The TTL a call asked for (None or 0: the default), within [min(1 s, default), cap]:
        a lease that would expire before its answer arrives is no use to anyone."""
        if not ttl_s:
            return self.config.lease_ttl_s
        low = min(MIN_LEASE_TTL_S, self.config.lease_ttl_s)
        if not low <= ttl_s <= self.config.max_lease_ttl_s:
            raise InvalidArgument(f"lease ttl {ttl_s:g} s is outside [{low:g}, "
                                  f"{self.config.max_lease_ttl_s:g}] (the server's cap)")
        return ttl_s

    def _check_room_for(self, owner: str, new_leases: int, new_namespaces: int) -> None:
        """LimitExceeded unless `owner` may open `new_leases` more leases and the service
        `new_namespaces` more namespaces."""
        held = self._leases_of_owner.get(owner, 0)
        if held + new_leases > self.config.max_leases_per_client:
            raise LimitExceeded(f"client {owner!r} holds {held} live leases and asked for "
                                f"{new_leases} more; limit {self.config.max_leases_per_client} "
                                "per client (release leases when done)")
        if new_namespaces and len(self._namespaces) + new_namespaces > self.config.max_namespaces:
            raise LimitExceeded(f"{len(self._namespaces)} namespaces hold blocks or leases and "
                                f"{new_namespaces} more were asked for; limit "
                                f"{self.config.max_namespaces}")

    def _check_insert(self, tokens: bytes, block_ids: Sequence[int],
                      window_ids: Sequence[int] = ()) -> None:
        self._check_tokens(tokens)
        num_full = num_tokens(tokens) // self.block_size
        if len(block_ids) != num_full:
            raise InvalidArgument(
                f"{len(block_ids)} block ids for {num_full} full blocks "
                f"({num_tokens(tokens)} tokens, block_size {self.block_size})")
        if window_ids:
            if not self.window_blocks:
                raise InvalidArgument("window parts given for a pool without a sliding window")
            if len(window_ids) > num_full:
                raise InvalidArgument(f"{len(window_ids)} window parts for {num_full} full "
                                      "blocks: a window part needs its block's full part")
            real = [w for w in window_ids if w != HOLE]
            if len(set(real)) != len(real):
                raise InvalidArgument("window part ids repeat within one insert")
            for w in real:
                if not (0 <= w < self.pool.num_blocks and self.pool.is_window(w)):
                    raise InvalidArgument(f"id {w} is not a window part of this pool")
        if len(set(block_ids)) != len(block_ids):
            raise InvalidArgument("block ids repeat within one insert")
        full = self.pool.num_full_blocks
        if block_ids and not (0 <= min(block_ids) and max(block_ids) < full):
            b = next(b for b in block_ids if not 0 <= b < full)
            raise InvalidArgument(f"block id {b} is out of range (pool has {full} blocks"
                                  + (", then window parts)" if self.window_blocks else ")"))
        if self.pool.num_sink_blocks and block_ids and not self.pool.is_sink(block_ids[0]):
            raise InvalidArgument(
                f"block {block_ids[0]} holds position 0 but is not a sink block: this pool "
                f"keeps the first {self.pool.layout.sink_tokens} tokens of every sequence in "
                f"{self.pool.layout.model_dtype} (Allocate with starts_sequence)")

    def _check_claims(self, lease: _Lease, namespace: str, tokens: bytes,
                      block_ids: Sequence[int], claimed: set[int]) -> None:
        """Each id is the lease's own (and not claimed by an earlier item of the batch) or the
        id the tree already caches at that position."""
        if namespace != lease.namespace:
            raise PermissionDenied(f"lease {lease.lease_id} belongs to namespace "
                                   f"{lease.namespace!r}, not {namespace!r}")
        cached = self._namespaces[namespace].tree.match(tokens).block_ids
        rest = block_ids[len(cached):]
        if (tuple(block_ids[:len(cached)]) == cached and claimed.isdisjoint(rest)
                and lease.owned.keys() >= set(rest)):  # the common case, in C
            claimed.update(rest)
            return
        for i, b in enumerate(block_ids):
            if not (i < len(cached) and cached[i] == b):
                self._claim(lease, b, claimed, "block")

    def _claim(self, lease: _Lease, b: int, claimed: set[int], what: str) -> None:
        """Claim id `b` (a "block" or "window part") for an insert: the lease's own, not yet
        claimed by another item; else the precise error."""
        if b in claimed:
            raise InvalidArgument(f"{what} {b} is claimed by two items of one insert")
        if b in lease.owned:
            claimed.add(b)
            return
        if any(b in other.owned for other in self._leases.values()):
            raise PermissionDenied(f"{what} {b} is leased to another lease, not {lease.lease_id}")
        if self.pool.is_free(b):
            raise PermissionDenied(f"{what} {b} is not allocated to lease {lease.lease_id}")
        raise AlreadyExists(f"{what} {b} is already cached "
                            + ("under another prefix" if what == "block" else "at another block"))

    def _check_window_claims(self, lease: _Lease, tokens: bytes, window_ids: Sequence[int],
                             claimed: set[int]) -> None:
        """Each window part is the lease's own (unclaimed) or the one cached at its block."""
        tree = self._namespaces[lease.namespace].tree
        assert isinstance(tree, WindowedRadixTree)
        cached = tree.window_parts(tokens)
        first = len(cached) - len(window_ids)
        for i, w in enumerate(window_ids, first):
            if w != HOLE and cached[i] != w:
                self._claim(lease, w, claimed, "window part")

    def _cached_windows(self) -> int:
        return sum(ns.tree.num_window_blocks for ns in self._namespaces.values()
                   if isinstance(ns.tree, WindowedRadixTree))

    @staticmethod
    def _hints(hints: Sequence[str | int | None] | None, count: int) -> list[int]:
        """One hint code per item (all NO_HINT for None); InvalidArgument on a bad one."""
        if hints is None or not len(hints):
            return [NO_HINT] * count
        if len(hints) != count:
            raise InvalidArgument(f"{len(hints)} retention hints for {count} items: give none "
                                  "or one per item")
        return [parse_hint(h) for h in hints]

    def _apply_insert(self, lease: _Lease, tokens: bytes, block_ids: Sequence[int],
                      pin: bool = True, hint: int = NO_HINT,
                      window_ids: Sequence[int] = ()) -> InsertResult:
        ns = self._namespaces[lease.namespace]
        self._touch(lease)
        if isinstance(ns.tree, WindowedRadixTree):
            result = ns.tree.insert(tokens, block_ids, hint, window_ids=window_ids)
        else:
            result = ns.tree.insert(tokens, block_ids, hint)
        gone = result.adopted + result.duplicates  # no longer the lease's
        deque(map(lease.owned.pop, gone), 0)
        if result.duplicates:
            self.pool.free(list(result.duplicates))
        if pin:  # what was inserted, for the rest of the lease: the engine may still read it
            m = ns.tree.match(tokens)
            if m.num_tokens:
                ns.tree.lock(m.handle, hit=False)
                lease.handles.append(m.handle)
        self.events.publish(ns.name, ns.tree.take_events())
        return result

    def _check_tokens(self, tokens: bytes) -> None:
        if not tokens:
            raise InvalidArgument("empty token list")
        if len(tokens) % TOKEN_BYTES:
            raise InvalidArgument(f"tokens are {len(tokens)} bytes, not a whole number of "
                                  "little-endian uint32 ids")
        n = num_tokens(tokens)
        if n > self.config.max_tokens:
            raise InvalidArgument(f"{n} tokens, limit {self.config.max_tokens}")
        vocab = self.config.vocab_size
        if vocab is not None:
            ids = from_token_bytes(tokens)
            if int(ids.max()) >= vocab:
                i = int(np.argmax(ids >= vocab))
                raise InvalidArgument(f"token id {int(ids[i])} at index {i} is out of range "
                                      f"(vocab_size {vocab})")

    def _namespace(self, name: str) -> _Namespace:
        """The namespace, created if absent (callers checked the limit first)."""
        ns = self._namespaces.get(name)
        if ns is None:
            clock = functools.partial(next, self._ticks)
            tree = (WindowedRadixTree(self.block_size, self.window_blocks, self._policies(name),
                                      clock=clock) if self.window_blocks
                    else RadixTree(self.block_size, self._policies(name), clock=clock))
            ns = _Namespace(name, tree)
            self._namespaces[name] = ns
        return ns

    def _drop_namespace(self, ns: _Namespace) -> None:
        """Forget a namespace that holds no blocks and no leases; its counters stay."""
        self._retired.add(ns.life)
        del self._namespaces[ns.name]

    def _drop_if_empty(self, ns: _Namespace) -> None:
        if not ns.num_leases and not ns.tree.num_cached_blocks:
            self._drop_namespace(ns)

    def _open_lease(self, owner: str, ns: _Namespace, ttl_s: float) -> _Lease:
        lease_id = next(self._lease_ids)
        lease = _Lease(lease_id, owner, ns.name, self._clock() + ttl_s, ttl_s)
        self._leases[lease_id] = lease
        self._leases_of_owner[owner] = self._leases_of_owner.get(owner, 0) + 1
        ns.num_leases += 1
        return lease

    def _get_lease(self, owner: str, lease_id: int) -> _Lease:
        """The live lease `lease_id` of `owner` (not renewed: callers `_touch` it once their
        checks passed)."""
        lease = self._leases.get(lease_id)
        if lease is not None and lease.expires_at <= self._clock():
            self._end_lease(lease, expired=True)
            lease = None
        if lease is None:
            if lease_id in self._expired:
                raise LeaseExpired(f"lease {lease_id} expired (ttl {self.config.lease_ttl_s:g} s);"
                                   " its pins and blocks were released")
            raise NotFound(f"unknown lease {lease_id}")
        if lease.owner != owner:
            raise PermissionDenied(f"lease {lease_id} belongs to another client")
        return lease

    def _touch(self, lease: _Lease) -> None:
        lease.expires_at = self._clock() + lease.ttl_s

    def _leased_blocks(self) -> int:
        """Blocks allocated to leases and not yet inserted or freed (for stats and messages:
        O(live leases))."""
        return sum(len(lease.owned) for lease in self._leases.values())

    def _end_lease(self, lease: _Lease, expired: bool = False, hint: int = NO_HINT) -> int:
        ns = self._namespaces[lease.namespace]
        if hint != NO_HINT and lease.handles:  # the last handle pins the deepest path
            ns.tree.hint(lease.handles[-1], hint)
        for handle in lease.handles:
            ns.tree.unlock(handle)
        freed = list(lease.owned)
        if freed:
            self.pool.free(freed)
        del self._leases[lease.lease_id]
        left = self._leases_of_owner[lease.owner] - 1
        if left:
            self._leases_of_owner[lease.owner] = left
        else:
            del self._leases_of_owner[lease.owner]
        ns.num_leases -= 1
        self._drop_if_empty(ns)
        if expired:
            self._num_expired += 1
            self._expired[lease.lease_id] = None
            if len(self._expired) > EXPIRED_MEMORY:
                self._expired.popitem(last=False)
        return len(freed)

    def _make_room(self, num_blocks: int, keep: _Namespace | None = None, sinks: int = 0,
                   windows: int = 0) -> int:
        """Evict until `num_blocks` are free, `sinks` of them sink blocks, the policy's first
        victim first across all namespaces (their trees share one clock and policy state, so
        their victims compare), and `windows` window parts (windowed pools: window parts
        alone first, then whole leaves). Raises OutOfBlocks, evicting nothing, when even that
        cannot make room (a search for a sink block or window part keeps what it evicted).
        Namespaces left empty are dropped, except `keep` (about to get a lease)."""
        evicted = 0
        if windows:
            evicted += self._evict_windows_for(windows, keep)
        while self.pool.num_free_sink < min(sinks, self.pool.num_sink_blocks):
            try:
                evicted += self._evict_for(self.pool.num_free + 1, keep)  # one more block
            except OutOfBlocks:
                raise OutOfBlocks(
                    f"no sink block for a sequence's first block: all "
                    f"{self.pool.num_sink_blocks} are leased or pinned (serve with a larger "
                    f"--kv-sink-fraction)") from None
        return evicted + self._evict_for(num_blocks, keep)

    def _evict_windows_for(self, windows: int, keep: _Namespace | None) -> int:
        """Free window parts until `windows` are: unprotected ones first (oldest namespace's
        first), then whole leaves. Returns the full parts evicted on the way."""
        pool, evicted = self.pool, 0
        spaces = [ns for ns in self._namespaces.values() if isinstance(ns.tree, WindowedRadixTree)]
        for ns in spaces:
            need = windows - pool.num_free_window
            if need <= 0:
                break
            assert isinstance(ns.tree, WindowedRadixTree)
            freed = ns.tree.evict_windows(need)
            if freed:
                pool.free(freed)
                self.events.publish(ns.name, ns.tree.take_events())
        while pool.num_free_window < windows:
            try:  # a whole leaf's tail: its window parts go with its full parts
                evicted += self._evict_for(pool.num_free + 1, keep)
            except OutOfBlocks:
                raise OutOfBlocks(
                    f"asked {windows} window parts: {pool.num_free_window} free of "
                    f"{pool.num_window_blocks}, the rest leased or pinned (serve with a larger "
                    f"--window-fraction)") from None
        return evicted

    def _evict_for(self, num_blocks: int, keep: _Namespace | None) -> int:
        need = num_blocks - self.pool.num_free
        if need <= 0:
            return 0
        evictable = sum(ns.tree.num_evictable_blocks for ns in self._namespaces.values())
        if evictable < need:
            raise OutOfBlocks(
                f"asked {num_blocks} blocks: {self.pool.num_free} free, {evictable} evictable, "
                f"{self._leased_blocks()} leased, "
                f"{sum(ns.tree.num_locked_blocks for ns in self._namespaces.values())} pinned "
                f"(pool {self.pool.num_full_blocks})")
        evicted = 0
        while evicted < need:
            keyed = sorted((key, name) for name, ns in self._namespaces.items()
                           if (key := ns.tree.next_victim_key()) is not None)
            ns = self._namespaces[keyed[0][1]]
            if len(keyed) == 1:
                freed = ns.tree.evict(need - evicted)
            else:  # the oldest tree's victims while they stay older than the runner-up's
                freed = []  # (a leaf at a time: its blocks share one key)
                while evicted + len(freed) < need:
                    freed += ns.tree.evict(need - evicted - len(freed), max_leaves=1)
                    key = ns.tree.next_victim_key()
                    if key is None or key > keyed[1][0]:
                        break
            self.pool.free(freed)
            if isinstance(ns.tree, WindowedRadixTree):  # full parts, then window parts
                events = ns.tree.take_events()
                freed = [b for ev in events if isinstance(ev, BlockRemoved)
                         for b in ev.block_ids]
                self.events.publish(ns.name, events)
            else:
                ns.tree.take_events()  # one BlockRemoved per chunk, in eviction order:
                self.events.publish(ns.name, [BlockRemoved(tuple(freed))])
            ns.life.evicted_blocks += len(freed)
            evicted += len(freed)
            if ns is not keep:
                self._drop_if_empty(ns)
        return evicted
