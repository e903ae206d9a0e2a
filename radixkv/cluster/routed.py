"""The engine side of a cluster: ask a router where a prompt's prefix is cached, then talk to that
member directly (the router never carries KV and is never on the Match path).

    with RoutedClient("unix:///run/radixkv-router.sock") as cluster:
        node, kv = cluster.choose("llama3@rev1", prompt)   # Route, then a Client to the member
        with kv.lease("llama3@rev1", prompt) as lease: ...  # as on one node
        # the member is gone (Unavailable)? cluster.failed(node), choose again

A member's Client (and its pool mapping) is opened once and kept.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import grpc

from radixkv.client import Client
from radixkv.cluster.router import RankedMember, RouteAnswer
from radixkv.protocol.env import check_socket_dir, client_tls_ca, client_token, normalize_target
from radixkv.protocol.errors import InvalidArgument, Unavailable
from radixkv.protocol.tokens import to_token_bytes
from radixkv.protocol.wire import call_credentials, message_dict, to_error
from radixkv.v1 import router_pb2 as pb
from radixkv.v1 import router_pb2_grpc

EXCLUDE_S = 2.0  # how long a member that failed a call is left out of our routes


class RouterClient:
    """Typed calls to a `radixkv router`. Thread-safe."""

    def __init__(self, target: str, timeout: float = 10.0, token: str | None = None,
                 tls_ca: str | None = None) -> None:
        """`token` (default $RADIXKV_AUTH_TOKEN): the cluster token; `tls_ca` (default
        $RADIXKV_TLS_CA): TLS to a router on TCP, trusting this CA. A Unix socket is checked
        as a member's is (radixkv.protocol.env.check_socket_dir)."""
        self.target = normalize_target(target)
        self.timeout = timeout
        if self.target.startswith("unix://"):
            check_socket_dir(self.target.removeprefix("unix://"))
        self._metadata = call_credentials(token or client_token())
        ca = tls_ca or client_tls_ca()
        if ca and not self.target.startswith("unix://"):
            try:
                with open(ca, "rb") as f:
                    root = f.read()
            except OSError as e:
                raise InvalidArgument(f"cannot read the TLS CA {ca}: {e}") from None
            self._channel = grpc.secure_channel(
                self.target, grpc.ssl_channel_credentials(root_certificates=root))
        else:
            self._channel = grpc.insecure_channel(self.target)
        self._stub = router_pb2_grpc.RouterStub(self._channel)  # type: ignore[no-untyped-call]

    def _call(self, name: str, request: Any) -> Any:
        try:
            return getattr(self._stub, name)(request, timeout=self.timeout,
                                             metadata=self._metadata)
        except grpc.RpcError as e:
            err = to_error(e)
            if isinstance(err, Unavailable) and "failed to connect" in str(err):
                raise Unavailable(f"no radixkv router at {self.target} (is `radixkv router` "
                                  f"running?): {err}") from None
            raise err from None

    def route(self, namespace: str, tokens: Any, exclude: Iterable[str] = (),
              probe: bool = False) -> RouteAnswer:
        r = self._call("Route", pb.RouteRequest(namespace=namespace,
                                                tokens=to_token_bytes(tokens),
                                                exclude=list(exclude), probe=probe))
        return RouteAnswer(tuple(RankedMember(m.node_id, m.address, m.epoch, m.cached_tokens,
                                              m.cost, m.load) for m in r.members),
                           r.block_size, r.namespace_known)

    def members(self) -> dict[str, Any]:
        return message_dict(self._call("Members", pb.MembersRequest()))

    def wait_members(self, count: int, timeout: float = 30.0) -> dict[str, Any]:
        """Block until `count` members are indexed (Unavailable after `timeout` s)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                m = self.members()
                if sum(x["state"] == "indexed" for x in m["members"]) >= count:
                    return m
            except Unavailable:
                m = {}
            if time.monotonic() > deadline:
                raise Unavailable(f"router {self.target}: fewer than {count} members indexed "
                                  f"after {timeout:g} s: {m.get('members', [])}")
            time.sleep(0.1)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> RouterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RoutedClient:
    """Route through a router, keep one Client per member. Not fork-safe."""

    def __init__(self, router: str, client_id: str | None = None, timeout: float = 30.0,
                 token: str | None = None, tls_ca: str | None = None) -> None:
        self.router = RouterClient(router, token=token, tls_ca=tls_ca)
        self.token, self.tls_ca = token, tls_ca
        self.client_id = client_id
        self.timeout = timeout
        self.clients: dict[str, Client] = {}
        self._addresses: dict[str, str] = {}
        self._failed: dict[str, float] = {}  # node id -> monotonic time it failed

    def excluded(self) -> list[str]:
        now = time.monotonic()
        return [n for n, t in self._failed.items() if now - t < EXCLUDE_S]

    def route(self, namespace: str, tokens: Any, probe: bool = False) -> RouteAnswer:
        return self.router.route(namespace, tokens, self.excluded(), probe)

    def member(self, node_id: str, address: str) -> Client:
        """The Client of a member (opened once; again if its address changed)."""
        kv = self.clients.get(node_id)
        if kv is None or self._addresses.get(node_id) != address:
            if kv is not None:
                kv.close()
            kv = self.clients[node_id] = Client(address, client_id=self.client_id,
                                                timeout=self.timeout, token=self.token,
                                                tls_ca=self.tls_ca)
            self._addresses[node_id] = address
        return kv

    def choose(self, namespace: str, tokens: Any) -> tuple[str, Client]:
        """Route, then the cheapest member's Client."""
        best = self.route(namespace, tokens).members[0]
        return best.node_id, self.member(best.node_id, best.address)

    def failed(self, node_id: str) -> None:
        """A call to this member failed (Unavailable): leave it out for a while and drop its
        Client (it reconnects, and re-maps the pool, if the member comes back)."""
        self._failed[node_id] = time.monotonic()
        kv = self.clients.pop(node_id, None)
        if kv is not None:
            kv.close()

    def close(self) -> None:
        for kv in self.clients.values():
            kv.close()
        self.clients.clear()
        self.router.close()

    def __enter__(self) -> RoutedClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
