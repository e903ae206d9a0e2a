"""Who may open what on a member's listeners: reflection and every stream behind the token, a
full stream pool refusing instead of queueing, a cap per TCP peer, and TCP only with a token
(or an explicit, loudly logged --insecure). Real servers in subprocesses."""

from __future__ import annotations

import queue
import re
import threading
import time

import grpc
import pytest
from _server import TOKEN, running_server
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from radixkv.client import Client
from radixkv.protocol import errors


def reflection_stream(target: str, timeout: float, metadata=()) -> tuple[object, queue.Queue]:
    """An open reflection stream (its request queue stays open: the stream holds a thread)."""
    requests: queue.Queue = queue.Queue()
    requests.put(reflection_pb2.ServerReflectionRequest(list_services=""))
    channel = grpc.insecure_channel(target)
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(iter(requests.get, None), timeout=timeout,
                                     metadata=metadata)
    return call, requests


def store(kv: Client, head: int) -> None:
    tokens = [head * 100 + i for i in range(8)]
    with kv.lease("ns", tokens) as lease:
        lease.insert(tokens, lease.block_ids + lease.new_block_ids, release=True)


def running(kv: Client, held: list) -> None:
    """Wait until each held Events stream runs on the server: each gets the next event."""
    store(kv, 99)
    for it in held:
        assert next(it).WhichOneof("kind") == "stored"


def test_reflection_needs_the_token_and_cannot_starve_subscribers(token_file):
    with running_server("--auth-token-file", token_file, "--stream-workers", "4") as s:
        target = f"unix://{s.socket}"
        opened = [reflection_stream(target, timeout=6) for _ in range(16)]
        for call, _ in opened:  # without the token: refused, no thread held
            with pytest.raises(grpc.RpcError) as e:
                next(call)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with Client(s.socket, token=TOKEN) as kv:
            got: list[object] = []
            reader = threading.Thread(
                target=lambda: got.extend(kv.events(from_sequence=0, timeout=4)))
            reader.start()
            time.sleep(0.5)
            for head in range(5):
                store(kv, head)
            reader.join()
            assert sum(ev.WhichOneof("kind") == "stored" for ev in got) == 5
            # with the token, reflection works
            call, requests = reflection_stream(target, timeout=5,
                                               metadata=(("authorization", f"Bearer {TOKEN}"),))
            assert "radixkv.v1.RadixKV" in {
                svc.name for svc in next(call).list_services_response.service}
            requests.put(None)
        for _, requests in opened:
            requests.put(None)


def test_a_full_stream_pool_refuses_at_once_instead_of_queueing(token_file):
    with running_server("--auth-token-file", token_file, "--stream-workers", "2") as s:
        with Client(s.socket, token=TOKEN) as kv:
            held = [kv.events(from_sequence=1, timeout=20) for _ in range(2)]
            running(kv, held)
            t0 = time.monotonic()
            with pytest.raises(errors.LimitExceeded, match="streams"):
                list(kv.events(from_sequence=0, timeout=5))
            assert time.monotonic() - t0 < 2.0  # refused, not queued until the deadline
            for it in held:
                it.close()


def test_streams_per_tcp_peer_are_capped(token_file):
    with running_server("--auth-token-file", token_file, "--stream-workers", "4",
                        "--tcp", "127.0.0.1:0") as s:
        port = re.search(r"127\.0\.0\.1:(\d+)", s.banner).group(1)
        with Client(f"127.0.0.1:{port}", token=TOKEN, timeout=10) as kv:
            held = [kv.events(from_sequence=1, timeout=20) for _ in range(2)]
            running(kv, held)
            with pytest.raises(errors.LimitExceeded, match="per peer"):
                list(kv.events(from_sequence=0, timeout=5))
            with Client(s.socket, token=TOKEN) as local:  # another peer still gets one
                assert list(local.events(from_sequence=0, timeout=0.5)) == []
            for it in held:
                it.close()


def test_tcp_needs_a_token_or_an_explicit_insecure_flag():
    with pytest.raises(errors.Unavailable, match="--insecure"):
        with running_server("--tcp", "127.0.0.1:0"):
            pass
    with running_server("--tcp", "127.0.0.1:0", "--insecure") as s:
        port = re.search(r"127\.0\.0\.1:(\d+)", s.banner).group(1)
        assert "INSECURE" in s.output() and f"127.0.0.1:{port}" in s.output()
        with Client(f"127.0.0.1:{port}", timeout=10) as kv:
            assert kv.pool_info().layout.block_size == 4
