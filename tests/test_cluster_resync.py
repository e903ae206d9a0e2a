"""How a router's follower rebuilds a member's part of the index, against a real etcd, real
members and a real router in subprocesses: backoff on repeated resyncs, DumpTree paged with a
cursor, and sliding-window members indexed by what they can resume."""

from __future__ import annotations

import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from _server import BLOCK_SIZE, tiny_config_path
from test_cluster import members, wait_for

from radixkv.cluster.etcd import Etcd, EtcdTarget
from radixkv.cluster.local import local_cluster
from radixkv.cluster.membership import make_info, member_key
from radixkv.cluster.routed import RouterClient
from radixkv.v1 import radixkv_pb2_grpc

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed")

NS = "chat@rev1"


@pytest.fixture
def flags(tmp_path):
    return ("--model-config", tiny_config_path(str(tmp_path)), "--block-size", str(BLOCK_SIZE),
            "--num-blocks", "64", "--log-level", "warning")


class RefusingMember(radixkv_pb2_grpc.RadixKVServicer):
    """A member that answers every Stats with INVALID_ARGUMENT (a bad or foreign build), and
    counts them: each is one rebuild attempt of a follower."""

    def __init__(self) -> None:
        self.stats_calls = 0

    def Stats(self, request, context):
        self.stats_calls += 1
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "refused")


def test_repeated_resyncs_back_off(flags, tmp_path):
    """The issue's case: a member answering INVALID_ARGUMENT got ~850 rebuilds a second. The
    follower must back off (exponentially, with jitter) instead."""
    member = RefusingMember()
    server = grpc.server(ThreadPoolExecutor(2))
    radixkv_pb2_grpc.add_RadixKVServicer_to_server(member, server)
    address = f"unix://{tmp_path}/bad.sock"
    server.add_insecure_port(address)
    server.start()
    try:
        with local_cluster(0, *flags) as c, RouterClient(c.router) as rc:
            info = make_info("bad", address, "e1", BLOCK_SIZE, 64, 1024, "tiny")
            etcd = Etcd(EtcdTarget.parse(c.etcd.url))
            etcd.put(member_key(EtcdTarget.parse(c.etcd.url), "bad"), info.to_json())
            etcd.close()
            wait_for(lambda: member.stats_calls > 0, what="the router to try the member")
            first = member.stats_calls
            time.sleep(4.0)
            tries = member.stats_calls - first
            assert members(rc)["bad"]["state"] != "indexed"
            assert "refused" in members(rc)["bad"]["error"]
        # backoff from 0.1 s, doubling, jitter of at most +-50 %: at most 7 tries in 4 s
        assert 2 <= tries <= 7, f"{tries} rebuilds in 4 s"
    finally:
        server.stop(0)
