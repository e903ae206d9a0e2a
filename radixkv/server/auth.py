"""Transport security for TCP (and, optionally, the Unix socket): TLS and a shared bearer token.

The Unix socket is guarded by file permissions (0600); TCP is opt-in and, beyond loopback,
should carry TLS (`--tls-cert/--tls-key`) and a token (`--auth-token-file` or
$RADIXKV_AUTH_TOKEN). With a token set, every radixkv.v1 call must send the metadata
`authorization: Bearer TOKEN` or gets UNAUTHENTICATED; health checking and reflection stay open
so that load balancers and grpcurl can probe the service.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from radixkv.errors import InvalidArgument
from radixkv.wire import AUTH_HEADER

PROTECTED_PREFIX = "/radixkv.v1.RadixKV/"


def read_token(path: str | None, env_value: str | None) -> str | None:
    """The token from a file (first line, stripped) or the environment; None when neither."""
    if path:
        try:
            token = Path(path).read_text().strip().splitlines()[0].strip()
        except (OSError, IndexError):
            raise InvalidArgument(f"cannot read an auth token from {path!r}") from None
    else:
        token = (env_value or "").strip()
    if token and len(token) < 16:
        raise InvalidArgument(f"the auth token is {len(token)} characters; use at least 16")
    return token or None


class TokenInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    """Rejects radixkv.v1 calls without the right bearer token (constant-time compare)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "missing or wrong auth token (metadata 'authorization: Bearer ...')")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    def intercept_service(self, continuation: Callable[[Any], Any],
                          details: grpc.HandlerCallDetails) -> Any:
        if not details.method.startswith(PROTECTED_PREFIX):
            return continuation(details)
        sent = dict(details.invocation_metadata or ()).get(AUTH_HEADER, "")
        if hmac.compare_digest(str(sent).encode(), self._expected):
            return continuation(details)
        return self._deny_stream if details.method.endswith("/Events") else self._deny


def server_credentials(cert: str | None, key: str | None) -> grpc.ServerCredentials | None:
    """TLS credentials from PEM files, or None when neither is given."""
    if not cert and not key:
        return None
    if not (cert and key):
        raise InvalidArgument("TLS needs both --tls-cert and --tls-key")
    try:
        pair = (Path(key).read_bytes(), Path(cert).read_bytes())
    except OSError as e:
        raise InvalidArgument(f"cannot read TLS files: {e}") from None
    return grpc.ssl_server_credentials([pair])

