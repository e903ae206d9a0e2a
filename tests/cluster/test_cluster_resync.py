"""How a router's follower rebuilds a member's part of the index, against a real etcd, real
members and a real router in subprocesses: backoff on repeated resyncs, DumpTree paged with a
cursor, and sliding-window members indexed by what they can resume."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from _server import BLOCK_SIZE, store_many, tiny_flags
from test_cluster import members, prompt, routes, wait_for

from radixkv.client import Client
from radixkv.cluster.local import local_cluster
from radixkv.cluster.routed import RouterClient
from radixkv.protocol.errors import RadixKVError
from radixkv.rpc.etcd import Etcd, EtcdTarget
from radixkv.rpc.membership import make_info, member_key
from radixkv.v1 import radixkv_pb2_grpc

NS = "chat@rev1"


@pytest.fixture
def flags(tmp_path):
    """Members of 64 blocks (one test here swaps that count for its own)."""
    return tiny_flags(str(tmp_path), 64)


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


def test_a_member_whose_tree_passes_the_message_limit_is_indexed_page_by_page(flags):
    """The issue's case at a small scale: a member whose whole DumpTree answer is larger than
    its message limit (64 MiB by default, 32 KiB here) was never indexed; the follower pages."""
    small = tuple(f if f != "64" else "4096" for f in flags)
    with local_cluster(1, *small, "--max-message-bytes", "32768") as c, \
            RouterClient(c.router) as rc, Client(c.members["n0"].socket) as kv:
        rc.wait_members(1)
        store_many(kv, NS, [[h * 1000 + i for i in range(2 * BLOCK_SIZE)] for h in range(1500)])
        with pytest.raises(RadixKVError, match="larger than max"):  # the whole tree at once
            kv.dump_tree(NS)
        # a router started now has to build the index from DumpTree
        second = c.start_router()
        with RouterClient(second.address) as rc2:
            rc2.wait_members(1)
            status = wait_for(lambda: members(rc2)["n0"]["indexed_blocks"] == 3000
                              and members(rc2)["n0"], what="all 3000 blocks indexed")
            assert status["state"] == "indexed"
            probe = rc2.route(NS, [7 * 1000 + i for i in range(2 * BLOCK_SIZE)], probe=True)
            assert probe.members[0].cached_tokens == 2 * BLOCK_SIZE


WINDOW = ("--sliding-window", "9", "--window-layers", "0")  # window_blocks = 2 (block size 4)


def store_windowed(kv: Client, tokens: list[int]) -> None:
    """One request on a sliding-window member: the window parts the Match allocated (its new
    tail's, and holes behind a resume point) go in with the blocks."""
    with kv.lease(NS, tokens) as lease:
        lease.insert(tokens, lease.block_ids + lease.new_block_ids, release=True,
                     window_ids=lease.new_window_ids)


def resumable(kv: Client, tokens: list[int]) -> int:
    with kv.lease(NS, tokens, store_tokens=0) as lease:
        return lease.num_tokens


def test_sliding_window_members_are_indexed_by_what_they_can_resume(flags):
    """A windowed member resumes a prefix only where the window parts of its last blocks are
    still held; the router must not promise more (window stored/removed events, and window
    parts in DumpTree)."""
    with local_cluster(1, *flags, *WINDOW, "--num-window-blocks", "4", "--policy", "lru") as c, \
            RouterClient(c.router) as rc, Client(c.members["n0"].socket) as kv:
        rc.wait_members(1)
        a, b, d = prompt(1, 3), prompt(3, 2), prompt(2, 3)
        store_windowed(kv, a)  # window parts on a's last 2 blocks
        store_windowed(kv, a + b)  # a's window parts now lie behind the new tail
        store_windowed(kv, d)  # needs 2 window parts: a's old tail's are freed
        asked = [a, a + b, d, a[:2 * BLOCK_SIZE], a[:BLOCK_SIZE] + [5] * BLOCK_SIZE]
        want = [resumable(kv, t) for t in asked]
        assert want[0] == 0 and want[1] == 5 * BLOCK_SIZE  # a itself: no longer resumable

        def cached() -> list[int]:
            return [dict(routes(rc, t))["n0"] for t in asked]

        wait_for(lambda: cached() == want, what=f"the router to say {want} (says {cached()})")
        # a router started now builds the same from DumpTree's window parts
        second = c.start_router()
        with RouterClient(second.address) as rc2:
            rc2.wait_members(1)
            wait_for(lambda: [dict(routes(rc2, t))["n0"] for t in asked] == want,
                     what="the second router's index")
