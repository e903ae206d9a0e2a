"""Prometheus metrics for one server (`radixkv serve --metrics-port PORT`, on 127.0.0.1).

What the service already counts is read from `KVService.stats()` at scrape time by a custom
collector, so nothing is counted twice and a scrape always agrees with the Stats RPC. Only RPC
latency and status codes are recorded here, by the servicer's one `rpc` wrapper. Each server has
its own CollectorRegistry (never the global one), so several servers in one process never collide.

| metric                                  | type      | meaning                                  |
| --------------------------------------- | --------- | ---------------------------------------- |
| radixkv_prefix_cache_queries_total      | counter   | tokens looked up by Match (vLLM's         |
|                                         |           | prefix_cache_queries)                    |
| radixkv_prefix_cache_hits_total         | counter   | of those, tokens found cached (vLLM's     |
|                                         |           | prefix_cache_hits)                       |
| radixkv_prefix_cache_requests_total     | counter   | Match queries (one per prompt)           |
| radixkv_blocks{state}                   | gauge     | pool blocks by state; the states         |
|                                         |           | partition the pool (see below)           |
| radixkv_pool_blocks, _block_bytes       | gauge     | pool size in blocks, bytes per block     |
| radixkv_evicted_blocks_total            | counter   | blocks evicted from the trees            |
| radixkv_leases                          | gauge     | live leases                              |
| radixkv_expired_leases_total            | counter   | leases ended by their TTL                |
| radixkv_namespaces                      | gauge     | namespaces with a tree                   |
| radixkv_events_total                    | counter   | KV events published (= last sequence)    |
| radixkv_uptime_seconds                  | gauge     | seconds since the service started        |
| radixkv_rpc_duration_seconds{method}    | histogram | unary RPC handling time, by method       |
| radixkv_rpc_errors_total{method,code}   | counter   | unary RPCs that failed, by status code   |

Block states: `free`, `leased` (allocated, not yet inserted), `cached` (in a tree, unpinned:
evictable) and `pinned` (in a tree, locked by a lease). Unlike the Stats RPC, where
`cached_blocks` includes the pinned ones, the gauge's states are disjoint, so they sum to
`radixkv_pool_blocks`. Errors that gRPC itself returns before the servicer runs (an oversized
message) are not seen here; the Events stream is not timed (its length is the subscriber's).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from radixkv.protocol.errors import AlreadyExists, InvalidArgument
from radixkv.protocol.values import ServiceStats
from radixkv.service import KVService
from radixkv.v1 import radixkv_pb2

# RPCs take tens of microseconds to a few milliseconds; the default buckets start at 5 ms.
RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
               0.5, 1.0, 2.5)
UNARY_METHODS = tuple(m.name for m in radixkv_pb2.DESCRIPTOR.services_by_name["RadixKV"].methods
                      if not m.server_streaming)


class ServiceCollector(Collector):
    """Reads `service.stats()` once per scrape."""

    def __init__(self, service: KVService) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        s = self.service.stats()
        yield CounterMetricFamily("radixkv_prefix_cache_queries",
                                  "Tokens looked up by Match (vLLM prefix_cache_queries)",
                                  value=s.query_tokens)
        yield CounterMetricFamily("radixkv_prefix_cache_hits",
                                  "Tokens of Match queries found cached (vLLM prefix_cache_hits)",
                                  value=s.hit_tokens)
        yield CounterMetricFamily("radixkv_prefix_cache_requests",
                                  "Match queries (one per prompt)", value=s.requests)
        blocks = GaugeMetricFamily("radixkv_blocks", "Pool blocks by state (disjoint: they sum "
                                   "to radixkv_pool_blocks; sliding-window pools: full parts)",
                                   labels=["state"])
        leased = s.num_blocks - s.free_blocks - s.cached_blocks  # Stats' leased has windows too
        for state, n in (("free", s.free_blocks), ("leased", leased),
                         ("cached", s.cached_blocks - s.pinned_blocks),
                         ("pinned", s.pinned_blocks)):
            blocks.add_metric([state], n)
        yield blocks
        if s.window_blocks:
            windows = GaugeMetricFamily("radixkv_window_parts", "Sliding-window pools: window "
                                        "parts by state (they sum to the window region)",
                                        labels=["state"])
            for state, n in (("free", s.free_window_blocks),
                             ("leased", s.leased_blocks - leased),
                             ("cached", s.cached_window_blocks)):
                windows.add_metric([state], n)
            yield windows
        yield GaugeMetricFamily("radixkv_pool_blocks", "Pool size in blocks", value=s.num_blocks)
        yield GaugeMetricFamily("radixkv_pool_block_bytes", "Bytes per pool block",
                                value=self.service.pool.layout.bytes_per_block)
        yield CounterMetricFamily("radixkv_evicted_blocks", "Blocks evicted from the trees",
                                  value=s.evicted_blocks)
        yield GaugeMetricFamily("radixkv_leases", "Live leases", value=s.live_leases)
        yield CounterMetricFamily("radixkv_expired_leases", "Leases ended by their TTL",
                                  value=s.expired_leases)
        yield GaugeMetricFamily("radixkv_namespaces", "Namespaces with a tree",
                                value=len(s.namespaces))
        yield CounterMetricFamily("radixkv_events", "KV events published (the last sequence "
                                  "number)", value=self.service.events.last_sequence)
        yield GaugeMetricFamily("radixkv_uptime_seconds", "Seconds since the service started",
                                value=s.uptime_s)
        if s.disk.capacity_blocks:
            yield from self._disk(s)

    @staticmethod
    def _disk(s: ServiceStats) -> Iterator[Metric]:
        """The tiers (pool, disk): hits, blocks and bytes of each; the disk tier's traffic."""
        d, bpb = s.disk, s.layout.bytes_per_block
        hits = CounterMetricFamily("radixkv_tier_hits", "Hit tokens by the tier they were "
                                   "found in (disk: promoted for the hit)", labels=["tier"])
        hits.add_metric(["memory"], s.hit_tokens - d.hit_tokens)
        hits.add_metric(["disk"], d.hit_tokens)
        yield hits
        blocks = GaugeMetricFamily("radixkv_tier_blocks", "Cached blocks by tier",
                                   labels=["tier"])
        blocks.add_metric(["memory"], s.cached_blocks)
        blocks.add_metric(["disk"], d.blocks)
        yield blocks
        size = GaugeMetricFamily("radixkv_tier_bytes", "Cached KV bytes by tier", labels=["tier"])
        size.add_metric(["memory"], s.cached_blocks * bpb)
        size.add_metric(["disk"], d.bytes)
        yield size
        yield GaugeMetricFamily("radixkv_disk_capacity_blocks", "Slots of the disk tier",
                                value=d.capacity_blocks)
        yield GaugeMetricFamily("radixkv_disk_up", "1 while the disk tier's writes succeed; 0 "
                                "while they fail and are retried (new demotions dropped)",
                                value=int(d.state == "ok"))
        yield GaugeMetricFamily("radixkv_disk_pending_writes", "Disk tier writes queued",
                                value=d.pending_writes)
        for name, value, what in (
                ("demoted_blocks", d.demoted_blocks, "Blocks the pool evicted to the disk tier"),
                ("promoted_blocks", d.promoted_blocks, "Blocks brought back from disk by a Match"),
                ("disk_evicted_blocks", d.evicted_blocks, "Blocks dropped from a full disk tier"),
                ("disk_verify_failures", d.verify_failures,
                 "Disk slots that failed their checksum when read (a miss)"),
                ("disk_write_errors", d.write_errors,
                 "Disk tier writes and fsyncs that failed (each failed retry counts)")):
            yield CounterMetricFamily(f"radixkv_{name}", what, value=value)


class Metrics:
    """One server's registry: the service collector plus RPC latency and errors. Implements
    the servicer's RpcObserver."""

    def __init__(self, service: KVService) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(ServiceCollector(service))
        self.rpc_seconds = Histogram("radixkv_rpc_duration_seconds",
                                     "Unary RPC handling time in the servicer", ["method"],
                                     registry=self.registry, buckets=RPC_BUCKETS)
        self.rpc_errors = Counter("radixkv_rpc_errors", "Unary RPCs that failed, by status code",
                                  ["method", "code"], registry=self.registry)
        # every series exists from the start, at zero; children kept (labels() costs ~3 us)
        self._rpc_seconds = {method: self.rpc_seconds.labels(method) for method in UNARY_METHODS}
        self._http: Any = None

    def observe_rpc(self, method: str, seconds: float, code: str) -> None:
        child = self._rpc_seconds.get(method)
        (child or self.rpc_seconds.labels(method)).observe(seconds)
        if code != "OK":
            self.rpc_errors.labels(method, code).inc()

    def start_http(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve /metrics on host:port in a daemon thread; returns the bound port."""
        if not 0 < port < 65536:
            raise InvalidArgument(f"metrics port must be in 1..65535, got {port}")
        try:
            self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise AlreadyExists(f"cannot serve metrics on {host}:{port}: {e.strerror}") from None
        return int(self._http.server_port)

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
