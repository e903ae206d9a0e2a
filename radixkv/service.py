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

A lease not used for `lease_ttl_s` expires (the server's sweeper calls `expire_leases`): its
pins are dropped and its leased blocks freed; a later call naming it gets LeaseExpired.
All public methods take one lock: the tree and pool are not thread-safe, and the work per call
is microseconds, so finer locking would not pay on CPython.
"""

from __future__ import annotations

import functools
import itertools
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from gpu_pool.base import BlockPool, PoolHandle
from radixkv.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    LeaseExpired,
    NotFound,
    OutOfBlocks,
    PermissionDenied,
)
from radixkv.events import EventLog
from radixkv.index.tree import BlockRemoved, InsertResult, NodeView, RadixTree
from radixkv.tokens import TOKEN_BYTES, from_token_bytes, num_tokens

MAX_NAMESPACE_LEN = 256
EXPIRED_MEMORY = 65536  # how many expired lease ids we remember, to tell "expired" from "unknown"


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    lease_ttl_s: float = 30.0
    max_tokens: int = 1 << 20  # per token list
    vocab_size: int | None = None  # when set, token ids must be < vocab_size
    max_namespaces: int = 1024
    policy: str = "lru"
    event_buffer: int = 65536
    recent_window: int = 1000  # requests in the "recent" hit rate


@dataclass(frozen=True, slots=True)
class LeaseMatch:
    """A Match's answer: the lease pinning `block_ids`, which hold the first `num_tokens`."""

    lease_id: int
    num_tokens: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Allocation:
    """Blocks leased to `lease_id`; `num_evicted` blocks were evicted to make room."""

    lease_id: int
    block_ids: tuple[int, ...]
    num_evicted: int


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


@dataclass(slots=True)
class _Lease:
    lease_id: int
    owner: str
    namespace: str
    expires_at: float
    handles: list[object] = field(default_factory=list)  # tree lock handles
    owned: dict[int, None] = field(default_factory=dict)  # leased block ids, in order


@dataclass(slots=True)
class _Namespace:
    name: str
    tree: RadixTree
    requests: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    evicted_blocks: int = 0


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
        self.events = EventLog(self.block_size, self.config.event_buffer)
        self._clock = clock
        self._started = clock()
        self._lock = threading.RLock()
        self._namespaces: dict[str, _Namespace] = {}
        self._leases: dict[int, _Lease] = {}
        self._expired: OrderedDict[int, None] = OrderedDict()
        self._lease_of_block: dict[int, int] = {}
        self._recent: deque[tuple[int, int]] = deque(maxlen=self.config.recent_window)
        self._num_expired = 0
        self._ticks = itertools.count(1)  # one LRU clock for every namespace's tree
        # Lease ids: a random start per service life, so ids from an earlier start are unknown.
        self._lease_ids = itertools.count(secrets.randbits(62) + 1)

    # ---- reads -------------------------------------------------------------------------------

    def pool_handle(self) -> PoolHandle:
        return self.pool.export()

    # ---- the request path --------------------------------------------------------------------

    def match(self, owner: str, namespace: str, tokens: bytes) -> LeaseMatch:
        """Longest cached prefix of `tokens` in `namespace`; opens a lease that pins it."""
        return self.match_many(owner, [(namespace, tokens)])[0]

    def match_many(self, owner: str, queries: Sequence[tuple[str, bytes]]) -> list[LeaseMatch]:
        """Batched match. All queries are validated before any lease opens."""
        for namespace, tokens in queries:
            self._check_namespace(namespace)
            self._check_tokens(tokens)
        out = []
        with self._lock:
            for namespace, tokens in queries:
                ns = self._namespace(namespace)
                lease = self._open_lease(owner, namespace)
                m = ns.tree.match(tokens)
                if m.num_tokens:
                    ns.tree.lock(m.handle)
                    lease.handles.append(m.handle)
                ns.requests += 1
                ns.query_tokens += num_tokens(tokens)
                ns.hit_tokens += m.num_tokens
                self._recent.append((num_tokens(tokens), m.num_tokens))
                out.append(LeaseMatch(lease.lease_id, m.num_tokens, m.block_ids))
        return out

    def allocate(
        self, owner: str, lease_id: int | None, namespace: str, num_blocks: int
    ) -> Allocation:
        """`num_blocks` free blocks leased to `lease_id` (a new lease in `namespace` if None),
        evicting unpinned LRU leaves when the free list is short."""
        if not 0 < num_blocks <= self.pool.num_blocks:
            raise InvalidArgument(
                f"num_blocks must be in 1..{self.pool.num_blocks}, got {num_blocks}")
        with self._lock:
            if lease_id:
                lease = self._get_lease(owner, lease_id)
                if namespace and namespace != lease.namespace:
                    raise PermissionDenied(f"lease {lease_id} belongs to namespace "
                                           f"{lease.namespace!r}, not {namespace!r}")
            else:
                self._check_namespace(namespace)
                lease = self._open_lease(owner, namespace)
            num_evicted = self._make_room(num_blocks)
            ids = self.pool.alloc(num_blocks)
            for b in ids:
                lease.owned[b] = None
                self._lease_of_block[b] = lease.lease_id
            return Allocation(lease.lease_id, tuple(ids), num_evicted)

    def insert(
        self, owner: str, lease_id: int, namespace: str, tokens: bytes, block_ids: Sequence[int]
    ) -> InsertResult:
        """Commit `block_ids` (one per full block of `tokens`) into the namespace's tree. Each
        id must be leased to `lease_id` or be the id the tree already holds at that position.
        Prefixes already cached are not adopted: those leased blocks return to the free list."""
        self._check_tokens(tokens)
        num_full = num_tokens(tokens) // self.block_size
        if len(block_ids) != num_full:
            raise InvalidArgument(
                f"{len(block_ids)} block ids for {num_full} full blocks "
                f"({num_tokens(tokens)} tokens, block_size {self.block_size})")
        if len(set(block_ids)) != len(block_ids):
            raise InvalidArgument("block ids repeat within one insert")
        for b in block_ids:
            if not 0 <= b < self.pool.num_blocks:
                raise InvalidArgument(f"block id {b} is out of range (pool has "
                                      f"{self.pool.num_blocks} blocks)")
        with self._lock:
            lease = self._get_lease(owner, lease_id)
            if namespace != lease.namespace:
                raise PermissionDenied(f"lease {lease_id} belongs to namespace "
                                       f"{lease.namespace!r}, not {namespace!r}")
            ns = self._namespace(namespace)
            cached = ns.tree.match(tokens).block_ids
            for i, b in enumerate(block_ids):
                if b in lease.owned or (i < len(cached) and cached[i] == b):
                    continue
                if b in self._lease_of_block:
                    raise PermissionDenied(f"block {b} is leased to another lease, not {lease_id}")
                if self.pool.is_free(b):
                    raise PermissionDenied(f"block {b} is not allocated to lease {lease_id}")
                raise AlreadyExists(f"block {b} is already cached under another prefix")
            result = ns.tree.insert(tokens, block_ids)
            for b in result.adopted + result.duplicates:  # no longer the lease's
                del lease.owned[b]
                del self._lease_of_block[b]
            if result.duplicates:
                self.pool.free(list(result.duplicates))
            # Pin what was inserted for the rest of the lease: the engine may still read it.
            m = ns.tree.match(tokens)
            if m.num_tokens:
                ns.tree.lock(m.handle, hit=False)
                lease.handles.append(m.handle)
            self.events.publish(namespace, ns.tree.take_events())
            return result

    def release(self, owner: str, lease_ids: Sequence[int]) -> int:
        """End leases: unpin, free leased blocks never inserted. Returns blocks freed."""
        with self._lock:
            leases = [self._get_lease(owner, lid) for lid in dict.fromkeys(lease_ids)]
            return sum(self._end_lease(lease) for lease in leases)

    def clear(self, namespace: str) -> int:
        """Drop every cached block of `namespace` and the namespace itself; publishes
        AllBlocksCleared. FailedPrecondition while a lease pins or holds anything in it."""
        with self._lock:
            ns = self._namespaces.get(namespace)
            if ns is None:
                raise NotFound(f"namespace {namespace!r} does not exist")
            holders = sum(1 for lease in self._leases.values() if lease.namespace == namespace)
            if holders:
                raise FailedPrecondition(
                    f"namespace {namespace!r} has {holders} live lease(s) "
                    f"({ns.tree.num_locked_blocks} blocks pinned); release them first")
            freed = ns.tree.evict(ns.tree.num_cached_blocks)
            ns.tree.take_events()
            self.pool.free(freed)
            del self._namespaces[namespace]
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
                               ns.requests, ns.query_tokens, ns.hit_tokens, ns.evicted_blocks)
                for ns in sorted(self._namespaces.values(), key=lambda n: n.name))
            cached = sum(ns.tree.num_cached_blocks for ns in self._namespaces.values())
            pinned = sum(ns.tree.num_locked_blocks for ns in self._namespaces.values())
            return ServiceStats(
                num_blocks=self.pool.num_blocks,
                free_blocks=self.pool.num_free,
                leased_blocks=len(self._lease_of_block),
                cached_blocks=cached,
                pinned_blocks=pinned,
                live_leases=len(self._leases),
                expired_leases=self._num_expired,
                requests=sum(n.requests for n in spaces),
                query_tokens=sum(n.query_tokens for n in spaces),
                hit_tokens=sum(n.hit_tokens for n in spaces),
                recent_requests=len(self._recent),
                recent_query_tokens=sum(q for q, _ in self._recent),
                recent_hit_tokens=sum(h for _, h in self._recent),
                evicted_blocks=sum(n.evicted_blocks for n in spaces),
                uptime_s=self._clock() - self._started,
                namespaces=spaces,
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
        """free + leased + cached == total, and each part's own invariants."""
        with self._lock:
            self.pool.check_integrity()
            for ns in self._namespaces.values():
                ns.tree.check_integrity()
            leased = sum(len(lease.owned) for lease in self._leases.values())
            assert leased == len(self._lease_of_block), (leased, len(self._lease_of_block))
            for lease in self._leases.values():
                for b in lease.owned:
                    assert self._lease_of_block[b] == lease.lease_id, b
            cached = sum(ns.tree.num_cached_blocks for ns in self._namespaces.values())
            total = self.pool.num_free + leased + cached
            assert total == self.pool.num_blocks, (
                f"free {self.pool.num_free} + leased {leased} + cached {cached} = {total} "
                f"!= {self.pool.num_blocks} blocks")

    # ---- internals ---------------------------------------------------------------------------

    def _check_namespace(self, namespace: str) -> None:
        if not namespace:
            raise InvalidArgument("namespace must not be empty")
        if len(namespace) > MAX_NAMESPACE_LEN:
            raise InvalidArgument(f"namespace is {len(namespace)} characters, "
                                  f"limit {MAX_NAMESPACE_LEN}")

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
        ns = self._namespaces.get(name)
        if ns is None:
            if len(self._namespaces) >= self.config.max_namespaces:
                raise OutOfBlocks(f"{len(self._namespaces)} namespaces exist, limit "
                                  f"{self.config.max_namespaces}")
            tree = RadixTree(self.block_size, self.config.policy,
                             clock=functools.partial(next, self._ticks))
            ns = _Namespace(name, tree)
            self._namespaces[name] = ns
        return ns

    def _open_lease(self, owner: str, namespace: str) -> _Lease:
        lease_id = next(self._lease_ids)
        lease = _Lease(lease_id, owner, namespace, self._clock() + self.config.lease_ttl_s)
        self._leases[lease_id] = lease
        return lease

    def _get_lease(self, owner: str, lease_id: int) -> _Lease:
        lease = self._leases.get(lease_id)
        now = self._clock()
        if lease is not None and lease.expires_at <= now:
            self._end_lease(lease, expired=True)
            lease = None
        if lease is None:
            if lease_id in self._expired:
                raise LeaseExpired(f"lease {lease_id} expired (ttl {self.config.lease_ttl_s:g} s);"
                                   " its pins and blocks were released")
            raise NotFound(f"unknown lease {lease_id}")
        if lease.owner != owner:
            raise PermissionDenied(f"lease {lease_id} belongs to another client")
        lease.expires_at = now + self.config.lease_ttl_s
        return lease

    def _end_lease(self, lease: _Lease, expired: bool = False) -> int:
        ns = self._namespaces.get(lease.namespace)
        for handle in lease.handles:
            assert ns is not None
            ns.tree.unlock(handle)
        freed = list(lease.owned)
        for b in freed:
            del self._lease_of_block[b]
        if freed:
            self.pool.free(freed)
        del self._leases[lease.lease_id]
        if expired:
            self._num_expired += 1
            self._expired[lease.lease_id] = None
            if len(self._expired) > EXPIRED_MEMORY:
                self._expired.popitem(last=False)
        return len(freed)

    def _make_room(self, num_blocks: int) -> int:
        """Evict until `num_blocks` are free, least recently used leaf first across all
        namespaces (their trees share one clock, so their victims compare). Raises OutOfBlocks,
        evicting nothing, when even that cannot make room."""
        need = num_blocks - self.pool.num_free
        if need <= 0:
            return 0
        evictable = sum(ns.tree.num_evictable_blocks for ns in self._namespaces.values())
        if evictable < need:
            raise OutOfBlocks(
                f"asked {num_blocks} blocks: {self.pool.num_free} free, {evictable} evictable, "
                f"{len(self._lease_of_block)} leased, "
                f"{sum(ns.tree.num_locked_blocks for ns in self._namespaces.values())} pinned "
                f"(pool {self.pool.num_blocks})")
        evicted = 0
        while evicted < need:
            keyed = sorted((key, name) for name, ns in self._namespaces.items()
                           if (key := ns.tree.next_victim_key()) is not None)
            ns = self._namespaces[keyed[0][1]]
            if len(keyed) == 1:
                freed = ns.tree.evict(need - evicted)
            else:  # take the oldest tree's blocks while they stay older than the runner-up's
                freed = []
                while evicted + len(freed) < need:
                    freed += ns.tree.evict(1)
                    key = ns.tree.next_victim_key()
                    if key is None or key > keyed[1][0]:
                        break
            self.pool.free(freed)
            ns.evicted_blocks += len(freed)
            evicted += len(freed)
            ns.tree.take_events()  # one BlockRemoved per chunk, in eviction order:
            self.events.publish(ns.name, [BlockRemoved(tuple(freed))])
        return evicted
