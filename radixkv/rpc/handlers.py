"""The wrapper of every unary gRPC handler: a project error becomes its status (the table in
radixkv.protocol.wire) with its class name in the trailing metadata, anything else INTERNAL and
logged; each call's latency and status go to the servicer's observer, if it has one."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, NoReturn, Protocol, TypeVar

import grpc

from radixkv.protocol.errors import RadixKVError
from radixkv.protocol.wire import STATUS, trailing_metadata

log = logging.getLogger("radixkv.server.app")

F = TypeVar("F", bound=Callable[..., Any])


class RpcObserver(Protocol):
    """Told about every unary call the `rpc` wrapper runs (radixkv.server.metrics implements it)."""

    def observe_rpc(self, method: str, seconds: float, code: str) -> None: ...


def abort(context: grpc.ServicerContext, method: str, e: Exception) -> NoReturn:
    """Abort through the one table: a project error keeps its status and class name; anything
    else is a bug and becomes INTERNAL. Raises (grpc's abort always does)."""
    if isinstance(e, RadixKVError):
        context.set_trailing_metadata(trailing_metadata(e))
        context.abort(STATUS.get(type(e), grpc.StatusCode.INTERNAL), str(e))
    else:
        log.error("internal error in %s", method, exc_info=e)
        context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")
    raise AssertionError("context.abort() returned")


def status_of(e: Exception) -> str:
    """The status code name `abort` gives `e`."""
    if isinstance(e, RadixKVError):
        return str(STATUS.get(type(e), grpc.StatusCode.INTERNAL).name)
    return "INTERNAL"


def rpc(method: F) -> F:
    """Turn project exceptions into statuses through STATUS; anything else is INTERNAL. Reports
    each call's latency and status code to the servicer's observer, if it has one."""
    name = method.__name__

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        observer = self.observer
        start = time.perf_counter() if observer is not None else 0.0
        try:
            response = method(self, request, context)
        except Exception as e:  # a project error, or a bug: say so, keep serving
            if observer is not None:
                observer.observe_rpc(name, time.perf_counter() - start, status_of(e))
            abort(context, name, e)
        if observer is not None:
            observer.observe_rpc(name, time.perf_counter() - start, "OK")
        return response

    return wrapper  # type: ignore[return-value]
