"""`radixkv router`: the Router (radixkv/cluster/router.py) served over gRPC (radixkv.v1.Router),
with health checking and reflection. Errors go through the servicer's one status table.
SIGTERM/SIGINT stop the server, every follower and the etcd watch, and unlink a Unix socket.

Access as on a member (radixkv/rpc/auth.py): with the cluster token every call but health
Check needs it; TCP needs a token or --insecure and takes TLS; a Unix socket is created 0600 in
a directory only this user can write, under a lock file, so a crashed router's stale socket is
replaced on restart and a live one is never taken over.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from radixkv.cluster.router import Router
from radixkv.protocol.errors import AlreadyExists, InvalidArgument
from radixkv.rpc.auth import AccessInterceptor, server_credentials
from radixkv.rpc.etcd import NO_SECURITY, EtcdSecurity, EtcdTarget
from radixkv.rpc.executor import SplitExecutor
from radixkv.rpc.handlers import rpc
from radixkv.rpc.process import insecure_warning, stop_on_signals
from radixkv.rpc.unix_socket import claim_socket, release_socket
from radixkv.v1 import router_pb2 as pb
from radixkv.v1 import router_pb2_grpc

log = logging.getLogger("radixkv.cluster")

BANNER = "radixkv router on"
ROUTER_SERVICE = "radixkv.v1.Router"
# a Route carries a whole prompt: accept what a member accepts (its --max-message-bytes
# default), not gRPC's 4 MiB, which is below a prompt of a member's default max_tokens
MAX_MESSAGE_BYTES = 64 << 20
WORKERS = 4
MAX_CONCURRENT_RPCS = 64  # running or queued; one more gets RESOURCE_EXHAUSTED at once


class RouterServicer(router_pb2_grpc.RouterServicer):
    observer = None  # the `rpc` wrapper reports to an observer when one is set

    def __init__(self, router: Router) -> None:
        self.router = router

    @rpc
    def Route(self, request: pb.RouteRequest, context: Any) -> pb.RouteResponse:
        answer = self.router.route(request.namespace, request.tokens,
                                   frozenset(request.exclude), request.probe)
        return pb.RouteResponse(block_size=answer.block_size,
                                namespace_known=answer.namespace_known, members=[
            pb.MemberRoute(node_id=m.node_id, address=m.address, epoch=m.epoch,
                           cached_tokens=m.cached_tokens, cost=m.cost, load=m.load)
            for m in answer.members])

    @rpc
    def Members(self, request: pb.MembersRequest, context: Any) -> pb.MembersResponse:
        r = self.router
        now = time.monotonic()
        out = pb.MembersResponse(etcd=f"{r.target.host}:{r.target.port}",
                                 prefix=r.target.members_prefix.decode(), routes=r.routes,
                                 uptime_s=now - r.started)
        for f in r.followers():
            blocks, namespaces = r.index.size(f.node_id)
            out.members.add(node_id=f.node_id, address=f.info.address, epoch=f.epoch,
                            state=f.state, error=f.error, block_size=f.info.block_size,
                            num_blocks=f.info.num_blocks, indexed_blocks=blocks,
                            namespaces=namespaces, events_applied=f.events_applied,
                            resyncs=f.resyncs, routed=f.routed, live_leases=f.live_leases,
                            registered_s=now - f.joined, **f.counters)
        return out


def listen_target(listen: str) -> str:
    """'/path' or 'unix:///path' -> a Unix socket target; 'HOST:PORT' as is."""
    if listen.startswith("/"):
        return f"unix://{listen}"
    if listen.startswith("unix://") or ":" in listen:
        return listen
    raise InvalidArgument(f"--listen {listen!r}: a socket path, unix:///path or HOST:PORT")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """`radixkv router`: where etcd is, where to listen, and who may call."""

    etcd: str
    listen: str
    token: str | None = None  # the cluster token: required from callers, sent to members
    tls_cert: str | None = None  # PEM files: TLS on a TCP listener
    tls_key: str | None = None
    insecure: bool = False  # allow TCP without a token (logged loudly)
    etcd_security: EtcdSecurity = NO_SECURITY
    stream_workers: int = 4  # health watches and reflection streams at once


def serve_router(config: RouterConfig, ready: Any = None) -> int:
    """Run a router until SIGTERM/SIGINT. `ready(address)` is called once it listens."""
    target = listen_target(config.listen)
    path = target.removeprefix("unix://") if target.startswith("unix://") else None
    if not path and not config.token and not config.insecure:
        raise InvalidArgument(
            f"--listen {config.listen} is TCP without a token: every local user (and anyone who "
            "reaches the port) could ask which prompts are cached. Give --auth-token-file (or "
            "$RADIXKV_AUTH_TOKEN), or --insecure if that is really meant")
    creds = server_credentials(config.tls_cert, config.tls_key)
    if creds is not None and path:
        raise InvalidArgument("--tls-cert/--tls-key are for a TCP --listen")
    lock = claim_socket(path, "radixkv router") if path else None
    try:
        return _serve(config, target, path, creds, ready)
    finally:
        if lock is not None and path:
            release_socket(path, lock)


def _serve(config: RouterConfig, target: str, path: str | None,
           creds: grpc.ServerCredentials | None, ready: Any) -> int:
    router = Router(EtcdTarget.parse(config.etcd), config.token, config.etcd_security)
    slots = config.stream_workers
    server = grpc.server(SplitExecutor(WORKERS, slots),
                         options=[("grpc.so_reuseport", 0),
                                  ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)],
                         interceptors=[AccessInterceptor(config.token, slots,
                                                         max(1, slots // 2))],
                         maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS)
    router_pb2_grpc.add_RouterServicer_to_server(  # type: ignore[no-untyped-call]
        RouterServicer(router), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (ROUTER_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    old = os.umask(0o177)
    try:
        port = (server.add_secure_port(target, creds) if creds is not None
                else server.add_insecure_port(target))
    finally:
        os.umask(old)
    if port == 0:
        raise AlreadyExists(f"cannot listen on {target}")
    address = target if path else f"{target.rsplit(':', 1)[0]}:{port}"
    if not path and not config.token:
        for line in insecure_warning(address):
            log.warning("%s", line)
    done = stop_on_signals()
    try:
        router.start()
        server.start()
        health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_servicer.set(ROUTER_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        router.synced.wait(5)
        if ready is not None:
            ready(address)
        while not done.wait(0.5):
            pass
    finally:
        health_servicer.enter_graceful_shutdown()
        server.stop(1).wait()
        router.stop()
        log.info("radixkv router stopped")
    return 0
