"""The requester's side of a peer fetch: before a Match, pull what another member holds.

`radixkv serve --cluster ... --peer-fetch` runs a Router inside the member (etcd membership,
one Follower per other member: the same ClusterIndex the router builds), and the servicer asks
`fill` before each Match batch:

    for each query (token ids, or SGLang's block keys), within --peer-fetch-timeout and
    the Match's own deadline:
      the index: the member holding the longest prefix (P blocks)     P < min: nothing
      a local Match pins what is here (L blocks)                      P - L < min: release
      Allocate P - L blocks on that lease (no room: release, nothing)
      FetchBlocks(start_block = L) from the holder (radixkv/server/peer_source.py), then its
        data connection (radixkv/rpc/block_channel.py): each block read straight into its pool
        block, then its checksum checked; the first bad or missing block ends the run
      Insert the verified leading run (L + V blocks) and release; the rest are freed
    then the Match runs as always and finds them
    a Match with peer_fetch_async (the vLLM connector's): the same fetch runs on a worker
      thread after the Match, whose answer says `fetching`; the engine asks again later

Faults are misses: a holder that is dead, restarted, evicting, slow or breaks the stream gives
the blocks verified before it (a leading run) or nothing; a failed peer is left out for a
backoff (as the router's followers back off). The service lock is held only inside each service
call, never across the network.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from radixkv.client.channel import open_channel
from radixkv.cluster.follower import backoff_s
from radixkv.cluster.router import RankedMember, Router
from radixkv.protocol.env import client_tls_ca, normalize_target
from radixkv.protocol.errors import InvalidArgument, OutOfBlocks, RadixKVError
from radixkv.protocol.tokens import TOKEN_BYTES
from radixkv.protocol.values import InsertItem, LeaseMatch, MatchQuery
from radixkv.protocol.wire import call_credentials, layout_pb
from radixkv.rpc import block_channel
from radixkv.rpc.etcd import NO_SECURITY, EtcdSecurity, EtcdTarget
from radixkv.server.peers import PeerCounters
from radixkv.service import KVService
from radixkv.v1 import radixkv_pb2 as pb
from radixkv.v1 import radixkv_pb2_grpc

log = logging.getLogger("radixkv.cluster")

DEFAULT_MIN_BLOCKS = 4
DEFAULT_TIMEOUT_S = 2.0
MAX_MESSAGE_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class PeerFetchConfig:
    node_id: str
    target: EtcdTarget
    token: str | None = None
    security: EtcdSecurity = NO_SECURITY
    min_blocks: int = DEFAULT_MIN_BLOCKS
    timeout_s: float = DEFAULT_TIMEOUT_S


@dataclass(frozen=True, slots=True)
class _Plan:
    """A fetch to make: from `holder`, which holds `held` blocks of `data` (tokens or keys)."""

    namespace: str
    key_size: int
    holder: RankedMember
    held: int
    data: bytes


@dataclass(slots=True)
class _Run:
    """What one stream brought: verified blocks written, their bytes, bad checksums, failed."""

    blocks: int = 0
    nbytes: int = 0
    bad: int = 0
    failed: bool = False


def check_pool(service: KVService) -> None:
    """InvalidArgument unless peer fetch can serve this pool: full-attention blocks of one
    format (no sink region, no window parts), on host memory."""
    pool = service.pool
    if pool.num_sink_blocks or pool.layout.window_blocks:
        raise InvalidArgument("--peer-fetch needs a pool of one block format: no sink blocks "
                              "(--sink-fraction 0) and no sliding window")
    if pool.backend != "host":
        raise InvalidArgument("--peer-fetch moves blocks from host pools only (a cuda pool "
                              "needs host staging: see docs/cluster.md)")


class PeerFetcher:
    """start() follows the cluster; fill() before Matches; stop() ends it all."""

    def __init__(self, service: KVService, config: PeerFetchConfig,
                 counters: PeerCounters) -> None:
        check_pool(service)
        self.service = service
        self.config = config
        self.counters = counters
        self.router = Router(config.target, config.token, config.security, skip=config.node_id)
        self.owner = f"peer-fetch:{config.node_id}"
        self.layout = layout_pb(service.pool.layout)
        self._credentials = call_credentials(config.token)
        self._tls = block_channel.client_context(client_tls_ca())
        self._lock = threading.Lock()
        self._stubs: dict[str, tuple[grpc.Channel, radixkv_pb2_grpc.RadixKVStub]] = {}
        self._failures: dict[str, tuple[int, float]] = {}  # node -> failures, left out until
        self._inflight: set[tuple[str, bytes]] = set()  # background fetches: namespace, tokens
        self._workers = ThreadPoolExecutor(2, thread_name_prefix="peer-fetch")

    def start(self) -> None:
        self.router.start()

    def stop(self) -> None:
        self._workers.shutdown(wait=True, cancel_futures=True)
        self.router.stop()
        with self._lock:
            for channel, _ in self._stubs.values():
                channel.close()
            self._stubs.clear()

    def fill(self, queries: Sequence[MatchQuery], deadline_s: float | None) -> None:
        """Fetch into the pool what peers hold beyond the local prefix of each query; never
        raises, never runs past `deadline_s` (seconds from now) or the configured timeout."""
        budget = self.config.timeout_s if deadline_s is None \
            else min(self.config.timeout_s, deadline_s * 0.8)
        end = time.monotonic() + budget
        for query in queries:
            if time.monotonic() >= end:
                return
            try:
                plan = self._plan(query)
                if plan is not None:
                    self._fetch(plan, end)
            except RadixKVError as e:  # a bad query: the Match itself says why
                log.debug("peer fetch skipped for %s: %s", query.namespace, e)

    def fill_async(self, queries: Sequence[MatchQuery],
                   answers: Sequence[LeaseMatch]) -> list[bool]:
        """For each query whose local answer a peer beats by min_blocks, fetch in the
        background (one fetch per prompt prefix at a time); True where one runs now."""
        out = []
        for query, answer in zip(queries, answers, strict=True):
            try:
                plan = self._plan(query, answer.num_tokens // self.service.block_size)
            except RadixKVError:
                plan = None
            if plan is None:
                out.append(False)
                continue
            key = (query.namespace, plan.data)
            with self._lock:
                running = key in self._inflight
                if not running:
                    self._inflight.add(key)
            if not running:
                self._workers.submit(self._fill_background, plan, key)
            out.append(True)
        return out

    def _fill_background(self, plan: _Plan, key: tuple[str, bytes]) -> None:
        try:
            self._fetch(plan, time.monotonic() + self.config.timeout_s)
        except RadixKVError as e:
            log.debug("peer fetch for %s failed: %s", plan.namespace, e)
        except Exception:
            log.exception("peer fetch for %s", plan.namespace)
        finally:
            with self._lock:
                self._inflight.discard(key)

    def _plan(self, query: MatchQuery, local: int = 0) -> _Plan | None:
        """The member holding the longest prefix of the query, its blocks and their tokens or
        keys; None unless it holds min_blocks more than `local` (and min_blocks at all)."""
        unit = query.key_size or TOKEN_BYTES * self.service.block_size  # bytes per block
        whole = len(query.data) // unit
        if whole < self.config.min_blocks + local or not self.router.followers():
            return None
        now = time.monotonic()
        with self._lock:
            out = frozenset(n for n, (_, until) in self._failures.items() if until > now)
        members = [m for m in self.router.route(query.namespace, query.data[:whole * unit], out,
                                                probe=True, key_size=query.key_size).members
                   if m.cached_tokens]
        if not members:
            return None
        holder = max(members, key=lambda m: (m.cached_tokens, -m.load))
        held = holder.cached_tokens // self.service.block_size
        if held < self.config.min_blocks + local:
            return None
        return _Plan(query.namespace, query.key_size, holder, held, query.data[:held * unit])

    def _fetch(self, plan: _Plan, end: float) -> None:
        """Pin the local prefix, fetch the rest of plan's blocks, insert the verified run."""
        bs, ns, key_size = self.service.block_size, plan.namespace, plan.key_size
        m = self.service.match(self.owner, ns, plan.data,
                               ttl_s=max(1.0, end - time.monotonic() + 1), key_size=key_size)
        released = False
        try:
            local = m.num_tokens // bs
            if plan.held - local < self.config.min_blocks:
                return
            try:
                alloc = self.service.allocate(self.owner, m.lease_id, ns, plan.held - local,
                                              key_size=key_size)
            except OutOfBlocks:
                return  # everything pinned: the Match misses as it would have
            start = time.monotonic()
            run = self._stream(plan, local, alloc.block_ids, end)
            if run.blocks:
                ids = (*m.block_ids, *alloc.block_ids[:run.blocks])
                unit = key_size or TOKEN_BYTES * bs
                self.service.insert_many(self.owner, [InsertItem(
                    m.lease_id, ns, plan.data[:len(ids) * unit], ids, key_size=key_size)],
                    [m.lease_id])
                released = True
            self._settle(plan.holder.node_id, run, (time.monotonic() - start) * 1e3)
        finally:
            if not released:
                self.service.release(self.owner, [m.lease_id])

    def _stream(self, plan: _Plan, local: int, block_ids: tuple[int, ...], end: float) -> _Run:
        """FetchBlocks from the plan's holder into `block_ids` (blocks local.. of the prompt):
        the verified leading run."""
        pool, run, holder = self.service.pool, _Run(), plan.holder
        request = pb.FetchBlocksRequest(client_id=self.owner, node_id=self.config.node_id,
                                        namespace=plan.namespace, tokens=plan.data,
                                        key_size=plan.key_size, start_block=local,
                                        layout=self.layout, max_blocks=len(block_ids))
        call = self._stub(holder.address).FetchBlocks(
            request, timeout=max(0.01, end - time.monotonic()), metadata=self._credentials)
        try:
            offer = next(call, None)
            if offer is None or offer.first_block != local or not offer.num_blocks:
                run.failed = offer is None
                return run
            host = block_channel.data_host(holder.address)
            with block_channel.connect(host, offer.data_port, offer.ticket, self._tls,
                                       end - time.monotonic()) as conn:
                for block in block_ids[:offer.num_blocks]:
                    ok = block_channel.recv_block(conn, local + run.blocks,
                                                  pool.block_bytes(block).data, end)
                    if not ok:
                        run.bad += ok is False  # a checksum failed (None: the stream ended)
                        run.failed = True
                        return run
                    run.blocks += 1
            for _ in call:  # the holder's end: its pin is gone
                pass
        except grpc.RpcError as e:
            run.failed = True
            log.info("peer fetch from %s stopped after %d blocks: %s %s", holder.node_id,
                     run.blocks, e.code().name, e.details())
        except OSError as e:
            run.failed = True
            log.info("peer fetch from %s stopped after %d blocks: %s", holder.node_id,
                     run.blocks, e)
        finally:
            run.nbytes = run.blocks * pool.layout.bytes_per_block
            call.cancel()
        return run

    def _settle(self, node: str, run: _Run, ms: float) -> None:
        self.counters.fetched(node, run.blocks, run.nbytes, ms, run.failed, run.bad)
        with self._lock:
            if run.failed:
                failures = self._failures.get(node, (0, 0.0))[0] + 1
                self._failures[node] = (failures, time.monotonic() + backoff_s(failures))
            else:
                self._failures.pop(node, None)

    def _stub(self, address: str) -> radixkv_pb2_grpc.RadixKVStub:
        with self._lock:
            got = self._stubs.get(address)
            if got is None:
                channel = open_channel(normalize_target(address), MAX_MESSAGE_BYTES)
                got = self._stubs[address] = (
                    channel, radixkv_pb2_grpc.RadixKVStub(channel))  # type: ignore[no-untyped-call]
            return got[1]
