"""Bounded queues under overload, against real servers: calls past the server's
`--max-concurrent-rpcs` are refused with RESOURCE_EXHAUSTED at once instead of waiting in an
unbounded queue, and a router accepts a Route of the largest prompt a member accepts."""

from __future__ import annotations

import shutil
import time

import grpc
import pytest
from _server import BLOCK_SIZE, running_server, tiny_flags

from radixkv.v1 import radixkv_pb2 as pb
from radixkv.v1 import radixkv_pb2_grpc

LIMIT = 256  # ServerConfig.max_concurrent_rpcs, the default `radixkv serve` runs with
STREAMS = LIMIT + 40


def test_calls_past_the_limit_are_refused_at_once_not_queued():
    # stream slots above the limit: here the limit on calls, not the one on streams, refuses
    with running_server("--stream-workers", str(STREAMS)) as s:
        channel = grpc.insecure_channel(f"unix://{s.socket}")
        stub = radixkv_pb2_grpc.RadixKVStub(channel)
        calls = [stub.Events(pb.EventsRequest(), timeout=30) for _ in range(STREAMS)]
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and sum(c.done() for c in calls) < STREAMS - LIMIT:
                time.sleep(0.05)
            refused = [c for c in calls if c.done()]
            # every call over the limit is answered, none waits for its deadline
            assert len(refused) == STREAMS - LIMIT, f"{len(refused)} of {STREAMS} answered"
            assert {c.code() for c in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        finally:
            for c in calls:
                c.cancel()
            channel.close()
        # once they are gone the server serves again
        channel = grpc.insecure_channel(f"unix://{s.socket}")
        stub = radixkv_pb2_grpc.RadixKVStub(channel)
        deadline = time.monotonic() + 10
        while True:
            try:
                info = stub.PoolInfo(pb.PoolInfoRequest(), timeout=5)
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert time.monotonic() < deadline, "the cancelled calls are never freed"
                time.sleep(0.1)
        assert info.layout.block_size == BLOCK_SIZE
        channel.close()


def test_max_concurrent_rpcs_is_a_flag():
    with running_server("--max-concurrent-rpcs", "4") as s:
        channel = grpc.insecure_channel(f"unix://{s.socket}")
        stub = radixkv_pb2_grpc.RadixKVStub(channel)
        calls = [stub.Events(pb.EventsRequest(), timeout=30) for _ in range(6)]
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and sum(c.done() for c in calls) < 2:
                time.sleep(0.05)
            assert [c.code() for c in calls if c.done()] == [
                grpc.StatusCode.RESOURCE_EXHAUSTED] * 2
        finally:
            for c in calls:
                c.cancel()
            channel.close()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed")
def test_the_router_accepts_a_max_tokens_prompt(tmp_path):

    from radixkv.client import Client
    from radixkv.cluster.local import local_cluster
    from radixkv.cluster.routed import RouterClient

    flags = tiny_flags(str(tmp_path))
    with local_cluster(1, *flags) as c, RouterClient(c.router) as rc:
        rc.wait_members(1)
        with Client(c.members["n0"].socket) as kv:
            max_tokens = kv.pool_info().max_tokens
        tokens = [i % 50000 for i in range(max_tokens)]  # 4 MiB of token ids: gRPC's default
        answer = rc.route("ns", tokens, probe=True)   # receive limit refused it
        assert [m.node_id for m in answer.members] == ["n0"]
        assert answer.members[0].cached_tokens == 0
