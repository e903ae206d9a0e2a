"""`radixkv router`: the Router (radixkv/cluster/router.py) served over gRPC (radixkv.v1.Router),
with health checking and reflection. Errors go through the servicer's one status table.
SIGTERM/SIGINT stop the server, every follower and the etcd watch, and unlink a Unix socket.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from radixkv.cluster.etcd import EtcdTarget
from radixkv.cluster.router import Router
from radixkv.errors import AlreadyExists, InvalidArgument
from radixkv.server.app import stop_on_signals
from radixkv.server.servicer import rpc
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


def serve_router(etcd: str, listen: str, ready: Any = None) -> int:
    """Run a router until SIGTERM/SIGINT. `ready(address)` is called once it listens."""
    target = listen_target(listen)
    path = target.removeprefix("unix://") if target.startswith("unix://") else None
    if path and os.path.exists(path):
        raise AlreadyExists(f"{path} exists: another router (or a stale socket) is there")
    router = Router(EtcdTarget.parse(etcd))
    server = grpc.server(ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="router"),
                         options=[("grpc.so_reuseport", 0),
                                  ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)],
                         maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS)
    router_pb2_grpc.add_RouterServicer_to_server(  # type: ignore[no-untyped-call]
        RouterServicer(router), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (ROUTER_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    if path:
        os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
    old = os.umask(0o177)
    try:
        port = server.add_insecure_port(target)
    finally:
        os.umask(old)
    if port == 0:
        raise AlreadyExists(f"cannot listen on {target}")
    address = target if path else f"{target.rsplit(':', 1)[0]}:{port}"
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
        if path and os.path.exists(path):
            os.unlink(path)
        log.info("radixkv router stopped")
    return 0

