"""The gRPC channel to one radixkv service: message limits, its own connection, TLS when a CA
is given (or $RADIXKV_TLS_CA). Client and a member's peer fetch open theirs here."""

from __future__ import annotations

import grpc

from radixkv.protocol import errors
from radixkv.protocol.env import client_tls_ca


def open_channel(target: str, max_message_bytes: int, tls_ca: str | None = None) -> grpc.Channel:
    """A channel to `target` (normalized); InvalidArgument if the TLS CA cannot be read."""
    options = [("grpc.max_receive_message_length", max_message_bytes),
               ("grpc.max_send_message_length", max_message_bytes),
               # a connection of its own: the server's per-client limits count TCP
               # connections, and two Clients of one process are two clients
               ("grpc.use_local_subchannel_pool", 1)]
    ca = tls_ca or client_tls_ca()
    if not ca:
        return grpc.insecure_channel(target, options=options)
    try:
        with open(ca, "rb") as f:
            root = f.read()
    except OSError as e:
        raise errors.InvalidArgument(f"cannot read the TLS CA {ca!r}: {e}") from None
    creds = grpc.ssl_channel_credentials(root_certificates=root)
    return grpc.secure_channel(target, creds, options=options)


def check_health(channel: grpc.Channel, service: str, timeout: float) -> str:
    """The standard health Check's status name (SERVING, NOT_SERVING, ...)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from radixkv.protocol.wire import to_error

    stub = health_pb2_grpc.HealthStub(channel)
    try:
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.RpcError as e:
        raise to_error(e) from None
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))
