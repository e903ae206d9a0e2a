"""The server's split thread pools against the real grpcio: stream handlers must run on the
stream pool and unary calls on the call pool. This fails loudly if grpcio renames the private
function `radixkv.rpc.executor` depends on."""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import grpc

from radixkv.rpc.executor import SplitExecutor, stream_behaviour


def _thread_name(_request: bytes, _context: Any) -> bytes:
    return threading.current_thread().name.encode()


def _thread_names(_request: bytes, _context: Any) -> Iterator[bytes]:
    yield threading.current_thread().name.encode()


def test_grpcio_still_has_the_private_stream_function() -> None:
    assert stream_behaviour() is not None, (
        "grpc._server._stream_response_in_pool is gone: update radixkv/rpc/executor.py")


def test_streams_and_calls_run_on_their_own_pools() -> None:
    handler = grpc.method_handlers_generic_handler("t.T", {
        "Unary": grpc.unary_unary_rpc_method_handler(_thread_name),
        "Stream": grpc.unary_stream_rpc_method_handler(_thread_names),
    })
    with tempfile.TemporaryDirectory(prefix="rkv-") as d:
        address = "unix:" + os.path.join(d, "s.sock")
        server = grpc.server(SplitExecutor(1, 1), handlers=[handler])
        server.add_insecure_port(address)
        server.start()
        try:
            with grpc.insecure_channel(address) as channel:
                unary = channel.unary_unary("/t.T/Unary")(b"", timeout=10)
                streamed = list(channel.unary_stream("/t.T/Stream")(b"", timeout=10))
        finally:
            server.stop(None)
    assert unary.decode().startswith("radixkv-call"), unary
    assert [s.decode().split("_")[0] for s in streamed] == ["radixkv-stream"], streamed
