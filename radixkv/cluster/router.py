"""The cache-aware router: membership from etcd, one Follower per member, Route over the index.

    etcd /radixkv/<cluster>/members/*  --watch-->  Router._members: node id -> Follower
    each Follower: DumpTree + Events of its member  -->  ClusterIndex (shared)
    Route(namespace, tokens): hash the prompt's blocks, walk the index, rank the members

Cost (lower is better), per healthy member m:

    cost(m) = uncached_tokens(m) + block_size x load(m)
    uncached_tokens(m) = prompt tokens - the prefix m holds cached (whole blocks)
    load(m) = the routes this router sent to m among its last 16 x members (probes not
              counted) + m's live leases at its last Stats poll (every 0.5 s)

so one request routed to a member weighs as much as one block of prefill it would save: a
member that already holds the prefix wins unless it is far busier, and prompts nobody holds
spread over the least-loaded members (ties: node id). The index is advisory: a stale answer
costs a cache miss, never wrong data, because the member's own Match decides. Every router
builds the same index from the same streams; only the load term is its own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass

from radixkv.cluster.follower import Follower
from radixkv.cluster.index import ClusterIndex
from radixkv.protocol.block_hashes import chain_hashes
from radixkv.protocol.errors import InvalidArgument, RadixKVError, Unavailable
from radixkv.protocol.tokens import TOKEN_BYTES
from radixkv.rpc.etcd import NO_SECURITY, Etcd, EtcdSecurity, EtcdTarget
from radixkv.rpc.membership import MemberInfo
from radixkv.service.checks import check_namespace

log = logging.getLogger("radixkv.cluster")

LOAD_WINDOW_PER_MEMBER = 16
POLL_S = 0.5


@dataclass(frozen=True, slots=True)
class RankedMember:
    node_id: str
    address: str
    epoch: str
    cached_tokens: int
    cost: float
    load: float


@dataclass(frozen=True, slots=True)
class RouteAnswer:
    members: tuple[RankedMember, ...]  # cheapest first
    block_size: int
    namespace_known: bool


class Router:
    """Start with start(); stop() stops every thread. Thread-safe."""

    def __init__(self, target: EtcdTarget, token: str | None = None,
                 security: EtcdSecurity = NO_SECURITY, skip: str = "") -> None:
        """`token`: the cluster token; it guards this router's callers, is sent to members,
        and only member records signed with it are followed (without one, every record is
        taken as is). `skip`: a node id not to follow (a member's own, for peer fetch)."""
        self.target = target
        self.token = token
        self.skip = skip
        self.index = ClusterIndex()
        self.etcd = Etcd(target, security=security)
        self.started = time.monotonic()
        self.routes = 0
        self._members: dict[str, Follower] = {}
        self._lock = threading.Lock()
        self._recent: deque[str] = deque()
        self._recent_counts: Counter[str] = Counter()
        self._missing: dict[str, float] = {}  # node -> monotonic time it is dropped, if unseen
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._watch, name="etcd-watch", daemon=True),
                         threading.Thread(target=self._poll, name="member-poll", daemon=True)]
        self.synced = threading.Event()  # set once membership was read from etcd
        self._ignored: dict[str, bytes] = {}  # node -> the unverifiable record last logged

    def start(self) -> None:
        if self.token is None:
            log.warning("no cluster token: member records in %s are followed unverified",
                        self.target)
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            followers = list(self._members.values())
            self._members.clear()
        for f in followers:
            f.stop(join=False)
        for f in followers:
            f.stop()
        for t in self._threads:
            t.join(5)
        self.etcd.close()

    # ---- membership --------------------------------------------------------------------------

    def _watch(self) -> None:
        """Read the members, then follow changes; on any etcd error read again (nothing is
        dropped while etcd is away: a member leaves only when its key is deleted)."""
        prefix = self.target.members_prefix
        warned = outage = False
        while not self._stop.is_set():
            try:
                kvs, revision = self.etcd.get_prefix(prefix)
                self._reconcile({k[len(prefix):].decode(): v for k, v in kvs}, outage)
                outage = False
                self.synced.set()
                if warned:
                    log.info("etcd at %s is back", self.target.grpc_target)
                    warned = False
                for batch in self.etcd.watch_prefix(prefix, revision + 1, self._stop):
                    for ev in batch:
                        node = ev.key[len(prefix):].decode()
                        if ev.deleted:
                            self._leave(node, "its key was deleted (stopped or lease expired)")
                        else:
                            self._join(node, ev.value)
            except RadixKVError as e:
                outage = True
                if not warned:
                    log.warning("membership: %s; retrying", e)
                    warned = True
            self._stop.wait(0.5)

    def _reconcile(self, records: dict[str, bytes], outage: bool = False) -> None:
        """Make the members those of `records`. After an etcd outage a member missing from
        etcd may only not have registered again yet (etcd restarted empty): it stays one of
        its TTLs + 1 s before it is dropped (by the poller), keeping its index."""
        now = time.monotonic()
        with self._lock:
            gone = [n for n in self._members if n not in records]
            if outage:
                for n in gone:
                    self._missing.setdefault(n, now + self._members[n].info.ttl_s + 1.0)
                gone = []
        for node in gone:
            self._leave(node, "no longer registered")
        for node, value in records.items():
            self._join(node, value)

    def _join(self, node: str, value: bytes) -> None:
        if node == self.skip:
            return
        try:
            info = MemberInfo.from_json(value)
            if info.node_id != node:
                raise InvalidArgument(f"its record names node id {info.node_id!r}")
            if self.token is not None and not info.verified(self.token):
                raise InvalidArgument(f"its record (address {info.address}) is not signed "
                                      "with the cluster token; not connecting to it")
        except InvalidArgument as e:
            if self._ignored.get(node) != value:  # once per record, not on every re-read
                self._ignored[node] = value
                log.warning("ignoring member key %s: %s", node, e)
            self._leave(node, "its record cannot be verified")
            return
        self._ignored.pop(node, None)
        with self._lock:
            self._missing.pop(node, None)
            old = self._members.get(node)
            if old is not None and old.info.address == info.address \
                    and old.info.epoch == info.epoch:
                old.info = info  # a re-registration (etcd restarted): keep following
                return
            follower = self._members[node] = Follower(info, self.index, self.token)
        if old is not None:
            old.stop(join=False)
            self.index.drop(node)
        log.info("member %s joined at %s (epoch %s)", node, info.address, info.epoch)
        follower.start()

    def _leave(self, node: str, why: str) -> None:
        with self._lock:
            self._missing.pop(node, None)
            follower = self._members.pop(node, None)
        if follower is not None:
            follower.stop(join=False)
            self.index.drop(node)
            log.info("member %s left: %s", node, why)

    def _poll(self) -> None:
        while not self._stop.wait(POLL_S):
            for f in self.followers():
                f.poll()
            now = time.monotonic()
            with self._lock:
                late = [n for n, t in self._missing.items() if t <= now]
            for node in late:
                self._leave(node, "did not register again after etcd came back")

    def followers(self) -> list[Follower]:
        with self._lock:
            return sorted(self._members.values(), key=lambda f: f.node_id)

    # ---- routing -----------------------------------------------------------------------------

    def route(self, namespace: str, tokens: bytes, exclude: frozenset[str] = frozenset(),
              probe: bool = False, key_size: int = 0) -> RouteAnswer:
        """Healthy members ranked by cost (module docstring). InvalidArgument for a bad
        namespace or no whole token; Unavailable when no member can be routed to. `key_size`:
        `tokens` holds block keys of that size (a key-keyed namespace; one key per block)."""
        check_namespace(namespace)
        if len(tokens) % TOKEN_BYTES:
            raise InvalidArgument(f"tokens are {len(tokens)} bytes, not a whole number of "
                                  f"{TOKEN_BYTES}-byte ids")
        if not tokens:
            raise InvalidArgument("tokens must not be empty: nothing to route")
        members = self.followers()
        healthy = [f for f in members if f.healthy and f.node_id not in exclude]
        if not healthy:
            states = ", ".join(f"{f.node_id} {f.state}" for f in members) or "none registered"
            raise Unavailable(f"no member to route to in {self.target} ({states}"
                              f"{'; excluded ' + ', '.join(sorted(exclude)) if exclude else ''})")
        n_tokens = len(tokens) // TOKEN_BYTES
        if key_size:  # a key per block: as many tokens as blocks of the members' size
            n_tokens = len(tokens) // key_size * healthy[0].info.block_size
        by_size: dict[int, list[Follower]] = {}
        for f in healthy:
            by_size.setdefault(f.info.block_size, []).append(f)
        cached: dict[str, int] = {}
        for block_size, group in by_size.items():
            hashes = chain_hashes(namespace, tokens, key_size // TOKEN_BYTES or block_size)
            got = self.index.cached_blocks(namespace, hashes, [f.node_id for f in group])
            cached.update({n: b * block_size for n, b in got.items()})
        with self._lock:
            loads = {f.node_id: self._recent_counts[f.node_id] + f.live_leases for f in healthy}
        ranked = sorted(
            (RankedMember(f.node_id, f.info.address, f.epoch, cached[f.node_id],
                          float(n_tokens - cached[f.node_id]
                                + f.info.block_size * loads[f.node_id]),
                          float(loads[f.node_id]))
             for f in healthy),
            key=lambda r: (r.cost, r.load, r.node_id))
        if not probe:
            self._count(ranked[0].node_id, len(members))
            for f in healthy:
                if f.node_id == ranked[0].node_id:
                    f.routed += 1
        return RouteAnswer(tuple(ranked), healthy[0].info.block_size,
                           self.index.knows(namespace))

    def _count(self, node: str, num_members: int) -> None:
        window = LOAD_WINDOW_PER_MEMBER * max(1, num_members)
        with self._lock:
            self.routes += 1
            self._recent.append(node)
            self._recent_counts[node] += 1
            while len(self._recent) > window:
                old = self._recent.popleft()
                self._recent_counts[old] -= 1
