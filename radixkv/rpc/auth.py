"""Transport security for TCP (and, optionally, the Unix socket): TLS and a shared bearer token.

The Unix socket is guarded by file permissions (0600); TCP is opt-in, needs a token
(`--auth-token-file` or $RADIXKV_AUTH_TOKEN) unless started with --insecure, and beyond loopback
should carry TLS (`--tls-cert/--tls-key`). With a token set, every call must send the metadata
`authorization: Bearer TOKEN` or gets UNAUTHENTICATED; only the health Check stays open, so that
load balancers can probe the service (it tells SERVING or not, nothing else). docs/security.md
has the whole picture.
"""

from __future__ import annotations

import hmac
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc

from radixkv.protocol.errors import InvalidArgument
from radixkv.protocol.wire import AUTH_HEADER, ERROR_KEY


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


OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check"})  # open even with a token


def _refusal(code: grpc.StatusCode, error: str, message: str) -> Callable[..., Any]:
    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        context.set_trailing_metadata(((ERROR_KEY, error),))
        context.abort(code, message)

    return refuse


class AccessInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    """Who may call what, and how many server streams run at once.

    With a token, every method but health Check needs `authorization: Bearer TOKEN` (compared
    in constant time): the radixkv services, reflection and the health Watch stream alike.
    Server streams (Events, health Watch, reflection) each hold one of `stream_slots` threads
    for their life; when all are taken a new stream is refused with RESOURCE_EXHAUSTED at once
    instead of queueing behind them, and one TCP peer (by address) may hold at most
    `per_peer` of them. Unix-socket peers are one user (the socket is 0600) and share the
    total only. Refusals are answered with a unary handler, which runs on the call threads,
    so a refused stream never waits for a stream thread."""

    def __init__(self, token: str | None, stream_slots: int, per_peer: int) -> None:
        self._expected = f"Bearer {token}".encode() if token else None
        self._slots = stream_slots
        self._per_peer = max(1, per_peer)
        self._lock = threading.Lock()
        self._active = 0
        self._peers: Counter[str] = Counter()
        deny = "missing or wrong auth token (metadata 'authorization: Bearer ...')"
        full = (f"all {stream_slots} server streams are in use (Events subscribers, watches, "
                "reflection): try again later or raise --stream-workers")
        self._deny = self._pair(grpc.StatusCode.UNAUTHENTICATED, "Unauthenticated", deny)
        self._full = self._pair(grpc.StatusCode.RESOURCE_EXHAUSTED, "LimitExceeded", full)

    @staticmethod
    def _pair(code: grpc.StatusCode, error: str, message: str) -> tuple[Any, Any]:
        fn = _refusal(code, error, message)
        return (grpc.unary_unary_rpc_method_handler(fn),
                grpc.stream_unary_rpc_method_handler(fn))

    def intercept_service(self, continuation: Callable[[Any], Any],
                          details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        client_streams = bool(handler is not None and handler.request_streaming)
        if self._expected is not None and details.method not in OPEN_METHODS:
            sent = dict(details.invocation_metadata or ()).get(AUTH_HEADER, "")
            if not hmac.compare_digest(str(sent).encode(), self._expected):
                return self._deny[client_streams]
        if handler is None or not handler.response_streaming:
            return handler
        with self._lock:
            if self._active >= self._slots:
                return self._full[client_streams]
            self._active += 1
        return self._wrap(handler)

    def _wrap(self, handler: Any) -> Any:
        """The stream's behaviour, releasing its slot when it ends (or, if grpc never runs it,
        when the handler is collected)."""
        ticket = _Ticket()
        release = weakref.finalize(ticket, self._release)
        inner = handler.stream_stream if handler.request_streaming else handler.unary_stream
        per_peer = self._per_peer

        def behaviour(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            assert ticket is not None  # keeps the ticket alive while the handler is
            peer = context.peer() or ""
            key = "" if peer.startswith("unix:") else peer.rsplit(":", 1)[0]
            with self._lock:
                held = self._peers[key] if key else 0
                if key and held < per_peer:
                    self._peers[key] += 1
            if key and held >= per_peer:
                release()
                context.set_trailing_metadata(((ERROR_KEY, "LimitExceeded"),))
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"this peer ({key}) holds {held} server streams, the limit per "
                              "peer: close one first")
            try:
                yield from inner(request, context)
            finally:
                if key:
                    with self._lock:
                        self._peers[key] -= 1
                        if not self._peers[key]:
                            del self._peers[key]
                release()

        make = (grpc.stream_stream_rpc_method_handler if handler.request_streaming
                else grpc.unary_stream_rpc_method_handler)
        return make(behaviour, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)

    def _release(self) -> None:
        with self._lock:
            self._active -= 1


class _Ticket:
    """One admitted stream; its slot is released when the stream ends or this is collected."""


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

