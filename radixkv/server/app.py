"""The gRPC server: a thin servicer over KVService, health checking, reflection, lifecycle.

Transport: a Unix domain socket by default (per-user path, 0600), TCP only when asked. A lock file
beside the socket stops a second server from silently taking over the same path. SIGTERM/SIGINT
drain in-flight calls, then unlink the socket and the pool's shared memory.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
from dataclasses import replace
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvpool import create_pool
from radixkv.protocol.errors import AlreadyExists, InvalidArgument, RadixKVError
from radixkv.rpc import block_channel
from radixkv.rpc.auth import AccessInterceptor, server_credentials
from radixkv.rpc.executor import SplitExecutor
from radixkv.rpc.process import insecure_warning, stop_on_signals
from radixkv.rpc.unix_socket import claim_socket, release_socket
from radixkv.server.config import ServerConfig
from radixkv.server.metrics import Metrics
from radixkv.server.peer_source import PeerSource
from radixkv.server.peers import PeerCounters
from radixkv.server.servicer import SERVICE_NAME, Servicer
from radixkv.service import KVService
from radixkv.service.table_writer import TableWriter
from radixkv.service.tier import NoTier
from radixkv.table import table_format
from radixkv.v1 import radixkv_pb2, radixkv_pb2_grpc

log = logging.getLogger("radixkv.server.app")

def check_exposure(config: ServerConfig) -> None:
    """TCP reaches every local user (and, beyond loopback, the network): it needs a token,
    unless the operator says --insecure (InvalidArgument otherwise)."""
    if config.tcp and not config.auth_token and not config.insecure:
        raise InvalidArgument(
            f"--tcp {config.tcp} without a token: every local user (and anyone who reaches the "
            "port) could read and clear the cache. Give --auth-token-file (or "
            "$RADIXKV_AUTH_TOKEN), or --insecure if that is really meant")


class RadixKVServer:
    """Owns the pool, the service, the grpc server and the lease sweeper."""

    def __init__(self, config: ServerConfig) -> None:
        check_exposure(config)
        self.config = config
        self._lock_file: Any = None
        self._stopped = threading.Event()
        self.pool = create_pool(config.layout, num_blocks=config.num_blocks,
                                backend=config.backend, device=config.device,
                                sink_fraction=config.sink_fraction,
                                num_window_blocks=config.num_window_blocks,
                                window_fraction=config.window_fraction)
        self.table: TableWriter | None = None
        try:
            tier = self._open_tier()
            self.service = KVService(self.pool, config.service, tier=tier)
            self._server = self._build()
            if config.lookup_table:
                self._open_table(tier.stats().capacity_blocks if tier is not None else 0)
        except BaseException:
            if self.table is not None:
                self.table.close()
            self.pool.close()
            raise
        self._sweeper = threading.Thread(target=self._sweep, name="lease-sweeper", daemon=True)
        self.addresses: list[str] = []
        self.metrics_url: str | None = None
        self.registration: Any = None  # radixkv.rpc.membership.Registration, with --cluster
        self.peer_fetch: Any = None  # radixkv.cluster.peer_fetch.PeerFetcher, with --peer-fetch
        self.kv_events: Any = None  # radixkv.server.vllm_events.VllmEventPublisher

    def attach_peer_fetch(self, fetcher: Any) -> None:
        """Ask `fetcher` (started here, stopped by stop()) before every Match."""
        self.peer_fetch = fetcher
        fetcher.start()
        self.servicer.peer_fetch = fetcher

    def attach_kv_events(self, publisher: Any) -> None:
        """Publish the event log on vLLM's wire (started here, stopped by stop())."""
        self.kv_events = publisher
        publisher.start()

    def _open_tier(self) -> NoTier | None:
        """The disk tier on --disk-dir (its index rebuilt from the file), or None."""
        cfg = self.config
        if not cfg.disk_dir:
            return None
        from radixkv.disk.directory import blocks_in, open_disk_tier

        blocks = cfg.disk_capacity_blocks
        if blocks is None:
            blocks = blocks_in(self.pool, cfg.disk_capacity_bytes or 0)
        tier = open_disk_tier(self.pool, cfg.disk_dir, blocks, cfg.disk_promote_blocks)
        s = tier.stats()
        log.info("disk tier on %s: %d slots of %d bytes, generation %d, %d blocks loaded",
                 cfg.disk_dir, s.capacity_blocks, s.slot_bytes, s.generation, s.loaded_blocks)
        return tier

    def _open_table(self, disk_blocks: int) -> None:
        """The lookup table, fed by the event log from now on (none for a windowed pool, or
        where its read protocol does not hold: radixkv/table/table_format.py)."""
        pool = self.pool
        if pool.layout.is_windowed or not table_format.supported():
            log.info("no lookup table: %s", "a windowed pool" if pool.layout.is_windowed
                     else "not an x86-64 machine")
            return
        self.table = TableWriter(pool.num_full_blocks + disk_blocks, pool.layout.block_size,
                                 pool.epoch)
        self.service.events.follow(self.table)
        self.servicer.table = (self.table.segment.name, self.table.segment.nbytes)

    def _build(self) -> grpc.Server:
        cfg = self.config
        options = [
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        per_peer = cfg.streams_per_peer or max(1, cfg.stream_workers // 2)
        interceptors = [AccessInterceptor(cfg.auth_token, cfg.stream_workers, per_peer)]
        server = grpc.server(SplitExecutor(cfg.workers, cfg.stream_workers),
                             options=options, interceptors=interceptors,
                             maximum_concurrent_rpcs=cfg.max_concurrent_rpcs)
        self.metrics: Metrics | None = None
        if cfg.metrics_port:
            self.metrics = Metrics(self.service)
        # peer fetch's data connections: on the gRPC TCP host, with its TLS
        source = PeerSource(self.service, PeerCounters(),
                            cfg.tcp.rsplit(":", 1)[0].strip("[]") if cfg.tcp else "127.0.0.1",
                            block_channel.server_context(cfg.tls_cert, cfg.tls_key))
        self.servicer = Servicer(self.service, cfg.service.max_tokens, self.metrics, source)
        radixkv_pb2_grpc.add_RadixKVServicer_to_server(  # type: ignore[no-untyped-call]
            self.servicer, server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = (radixkv_pb2.DESCRIPTOR.services_by_name["RadixKV"].full_name,
                 health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                 reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        return server

    def start(self) -> None:
        # Live leases and tree nodes are many long-lived small objects: a young-generation
        # collection every 700 allocations would rescan them over and over (measured: batched
        # Match 20-40 % slower with tens of thousands of live leases). Freeze what start-up
        # made and collect less often.
        gc.freeze()
        gc.set_threshold(50_000, 20, 20)
        cfg = self.config
        path = cfg.socket_path
        if path:
            self._bind_unix(path)
        if cfg.tcp:
            creds = server_credentials(cfg.tls_cert, cfg.tls_key)
            host = cfg.tcp.rsplit(":", 1)[0]
            if not cfg.auth_token:
                for line in insecure_warning(cfg.tcp):
                    log.warning("%s", line)
            if creds is None and host not in ("127.0.0.1", "localhost", "[::1]"):
                log.warning("TCP %s without TLS: anyone who reaches it can read the traffic; "
                            "give --tls-cert/--tls-key", cfg.tcp)
            if creds is None:
                port = self._server.add_insecure_port(cfg.tcp)
            else:
                port = self._server.add_secure_port(cfg.tcp, creds)
            if port == 0:
                raise AlreadyExists(f"cannot listen on TCP {cfg.tcp}")
            self.addresses.append(f"{host}:{port}")
        if self.metrics is not None and cfg.metrics_port:
            port = self.metrics.start_http(cfg.metrics_port)
            self.metrics_url = f"http://127.0.0.1:{port}/metrics"
        self._server.start()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        self._sweeper.start()
        if cfg.cluster:
            self._join_cluster()
        log.info("radixkv serving on %s: %s pool, %s, epoch %s", ", ".join(self.addresses),
                 self.pool.backend, self.pool.describe(), self.pool.epoch)
        if self.metrics_url:
            log.info("metrics on %s", self.metrics_url)

    def _join_cluster(self) -> None:
        """Register in etcd (radixkv.rpc.membership); Unavailable if etcd is unreachable."""
        from radixkv.rpc.etcd import EtcdTarget
        from radixkv.rpc.membership import Registration, make_info

        cfg = self.config
        if not cfg.node_id:
            raise InvalidArgument("--cluster needs --node-id (this member's name in the cluster)")
        address = cfg.advertise or self.addresses[0]
        layout = self.pool.layout
        info = make_info(cfg.node_id, address, self.pool.epoch, layout.block_size,
                         self.pool.num_blocks, layout.bytes_per_block,
                         f"{layout.num_layers} layers x {layout.num_kv_heads} kv heads x "
                         f"{layout.head_dim}, {layout.dtype}", cfg.cluster_ttl_s)
        info = replace(info, engine_url=cfg.engine_url)
        registration = Registration(EtcdTarget.parse(cfg.cluster or ""), info, cfg.cluster_ttl_s,
                                    token=cfg.auth_token, security=cfg.etcd_security,
                                    bound=frozenset(self.addresses))
        registration.start()  # Unavailable without etcd: the server stops, nothing registered
        self.registration = registration

    def _bind_unix(self, path: str) -> None:
        self._lock_file = claim_socket(path, "radixkv server")
        old = os.umask(0o177)  # the socket is created 0600: only this user may connect
        try:
            if self._server.add_insecure_port(f"unix://{path}") == 0:
                raise AlreadyExists(f"cannot bind unix socket {path}")
        finally:
            os.umask(old)
        self.addresses.append(f"unix://{path}")

    def _sweep(self) -> None:
        period = max(0.05, min(1.0, self.config.service.lease_ttl_s / 4))
        while not self._stopped.wait(period):
            n = self.service.expire_leases()
            if n:
                log.info("expired %d lease(s)", n)

    def stop(self, grace: float = 2.0) -> None:
        """Drain calls, stop the sweeper, unlink the socket and close the pool. Idempotent."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self.registration is not None:  # leave the cluster first: routers stop sending
            self.registration.stop()
        if self.peer_fetch is not None:
            self.servicer.peer_fetch = None
            self.peer_fetch.stop()
        self.health.enter_graceful_shutdown()
        self.servicer.close()  # end Events streams now rather than at the end of the grace
        self._server.stop(grace).wait()
        if self.metrics is not None:
            self.metrics.stop_http()
        path = self.config.socket_path
        if self._lock_file is not None and path:
            release_socket(path, self._lock_file)
        self.service.close_tier(write_down=True)  # a clean stop: the pool's cache goes down
        if self.kv_events is not None:  # after the tier: its write-down's events go out too
            self.kv_events.stop()
        if self.table is not None:
            self.service.events.follow(None)
            self.table.close()
        self.pool.close()
        log.info("radixkv stopped")

    def wait(self) -> None:
        self._server.wait_for_termination()


def serve(config: ServerConfig, ready: Any = None) -> int:
    """Run until SIGTERM/SIGINT. `ready(server)` is called once listening."""
    server = RadixKVServer(config)
    done = stop_on_signals()
    try:
        server.start()
        if ready is not None:
            ready(server)
        while not done.wait(0.5):
            pass
    except RadixKVError:
        raise
    finally:
        server.stop()
    return 0


