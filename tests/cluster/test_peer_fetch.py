"""Peer fetch between members (serve --cluster --peer-fetch): real etcd on loopback, two members
in subprocesses, TCP between them with the cluster token, bytes compared through each member's
own pool mapping."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from socket import create_connection

import grpc
import numpy as np
import pytest
from _server import BLOCK_SIZE, TOKEN, tiny_flags, wait_for

from radixkv.client import Client
from radixkv.cluster.local import LocalCluster, free_port, local_cluster
from radixkv.protocol.tokens import to_token_bytes
from radixkv.protocol.wire import call_credentials, layout_pb
from radixkv.rpc import block_channel
from radixkv.server.peer_source import CORRUPT_BLOCK_ENV
from radixkv.v1 import radixkv_pb2 as pb
from radixkv.v1 import radixkv_pb2_grpc

NS = "chat@rev1"
BLOCKS = 12  # > --peer-fetch-min-blocks (4) beyond anything the other member holds


ADDRESSES: dict[str, str] = {}  # node id -> its TCP address, as the last start gave it


def tcp_flags(token_file: str, node: str, again: bool = False) -> tuple[str, ...]:
    """`again`: the port of its last start (a restart on the same address)."""
    if not again:
        ADDRESSES[node] = f"127.0.0.1:{free_port()}"
    port = ADDRESSES[node].rsplit(":", 1)[1]
    return ("--tcp", f"127.0.0.1:{port}", "--advertise", f"127.0.0.1:{port}",
            "--auth-token-file", token_file, "--peer-fetch")


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """`env` set in os.environ (what a server started meanwhile inherits), then as before."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def two_members(tmp_path, token_file: str, *extra: str,
                env: dict[str, str] | None = None) -> Iterator[LocalCluster]:
    """etcd + members a and b, each on its own TCP port with the token and --peer-fetch;
    `env` (test hooks) for the holder a only."""
    flags = tiny_flags(str(tmp_path), num_blocks=64)
    with local_cluster(0, *flags, router=False) as c:
        with environment(env or {}):
            c.start_member("a", *tcp_flags(token_file, "a"), *extra)
        c.start_member("b", *tcp_flags(token_file, "b"), *extra)
        yield c


def prompt(head: int, blocks: int = BLOCKS) -> list[int]:
    return [head * 10_000 + i for i in range(blocks * BLOCK_SIZE)]


def store_random(socket: str, tokens: list[int], seed: int = 0) -> list[bytes]:
    """Cache `tokens` with random KV bytes; the bytes of each block, in order."""
    rng = np.random.default_rng(seed)
    with Client(socket, token=TOKEN) as kv, kv.lease(NS, tokens) as lease:
        ids = lease.block_ids + lease.new_block_ids
        out = []
        for b in ids:
            view = lease.pool().block_bytes(b)
            view[:] = rng.integers(0, 256, view.shape, dtype=np.uint8)
            out.append(bytes(view))
        lease.insert(tokens, ids, release=True)
    return out


def cached_bytes(socket: str, tokens: list[int]) -> list[bytes]:
    """What a Match on `socket` finds for `tokens`: the bytes of each hit block."""
    with Client(socket, token=TOKEN) as kv:
        m = kv.match(NS, tokens)
        try:
            pool = kv.pool_of(m.epoch)
            return [bytes(pool.block_bytes(b)) for b in m.block_ids]
        finally:
            kv.release(m.lease_id)


def peers(socket: str) -> dict[str, dict]:
    with Client(socket, token=TOKEN) as kv:
        return {p["node_id"]: p for p in kv.stats().get("peers", [])}


def inspect(socket: str) -> str:
    """`radixkv inspect` of a member, as an operator runs it."""
    out = subprocess.run([sys.executable, "-m", "radixkv", "inspect", "--socket", socket],
                         env={**os.environ, "RADIXKV_AUTH_TOKEN": TOKEN, "COLUMNS": "200"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_prefix_stored_on_one_member_hits_on_another_with_equal_bytes(tmp_path, token_file):
    with two_members(tmp_path, token_file) as c:
        a, b = c.members["a"].socket, c.members["b"].socket
        tokens = prompt(1)
        want = store_random(a, tokens)
        got = wait_for(lambda: (r := cached_bytes(b, tokens)) and len(r) == BLOCKS and r,
                       what="b to fetch a's prefix")
        assert got == want
        assert peers(b)["a"]["blocks_in"] == BLOCKS
        assert peers(b)["a"]["bytes_in"] == BLOCKS * len(want[0])
        assert peers(a)["b"]["blocks_out"] == BLOCKS
        shown = inspect(b)
        assert re.search(rf"peer a +fetched {BLOCKS} blocks \(12\.0 KiB\) in 1 fetches", shown)
        # a longer prompt on b: b holds the first 12 blocks now, a has nothing more
        assert len(cached_bytes(b, prompt(1) + [7] * 4 * BLOCK_SIZE)) == BLOCKS
        for s in (a, b):  # nothing pinned left on either side, invariants hold
            with Client(s, token=TOKEN) as kv:
                st = kv.stats(check_integrity=True)
                assert st["integrity"] == "ok" and st["live_leases"] == 0


def test_a_keyed_prefix_hits_on_another_member_with_equal_bytes(tmp_path, token_file):
    """SGLang's kind: blocks named by 16-byte keys (match_keys), fetched like token blocks."""
    keys = [i.to_bytes(16, "little") for i in range(100, 100 + BLOCKS)]
    ns = "hicache@rev1"
    with two_members(tmp_path, token_file) as c:
        a, b = c.members["a"].socket, c.members["b"].socket
        rng = np.random.default_rng(3)
        with Client(a, token=TOKEN) as kv:
            m = kv.match_keys(ns, keys, store=True)
            pool, want = kv.pool_of(m.epoch), []
            for block in m.new_block_ids:
                view = pool.block_bytes(block)
                view[:] = rng.integers(0, 256, view.shape, dtype=np.uint8)
                want.append(bytes(view))
            kv.insert_keys(ns, keys, m.new_block_ids, m.lease_id, m.epoch, release=True)

        def keyed_bytes() -> list[bytes]:
            with Client(b, token=TOKEN) as kv:
                m = kv.match_keys(ns, keys)
                try:
                    return [bytes(kv.pool_of(m.epoch).block_bytes(x)) for x in m.block_ids]
                finally:
                    kv.release(m.lease_id)

        got = wait_for(lambda: (r := keyed_bytes()) and len(r) == BLOCKS and r,
                       what="b to fetch a's keyed prefix")
        assert got == want
        assert peers(b)["a"]["blocks_in"] == BLOCKS
        for s in (a, b):
            with Client(s, token=TOKEN) as kv:
                st = kv.stats(check_integrity=True)
                assert st["integrity"] == "ok" and st["live_leases"] == 0


def test_a_corrupted_block_is_dropped_and_counted(tmp_path, token_file):
    with two_members(tmp_path, token_file, env={CORRUPT_BLOCK_ENV: "5"}) as c:
        a, b = c.members["a"].socket, c.members["b"].socket
        tokens = prompt(2)
        want = store_random(a, tokens, seed=2)
        got = wait_for(lambda: cached_bytes(b, tokens), what="b to fetch the leading run")
        assert got == want[:5]  # the verified leading run, never the damaged block
        p = peers(b)["a"]
        assert p["checksum_failures"] >= 1 and p["blocks_in"] == 5 and p["failures"] >= 1


def stub(address: str) -> radixkv_pb2_grpc.RadixKVStub:
    return radixkv_pb2_grpc.RadixKVStub(grpc.insecure_channel(address))


def test_another_layout_is_refused_before_any_byte_and_no_token_is_unauthenticated(
        tmp_path, token_file):
    from kvpool.layout import KVLayout

    with two_members(tmp_path, token_file) as c:
        a = c.members["a"]
        want = store_random(a.socket, prompt(3))
        address = ADDRESSES["a"]
        with Client(a.socket, token=TOKEN) as kv:
            layout = kv.pool_info().layout
        other = KVLayout(layout.num_layers, layout.num_kv_heads, layout.head_dim * 2,
                         layout.dtype, layout.block_size)
        request = pb.FetchBlocksRequest(client_id="t", namespace=NS,
                                        tokens=to_token_bytes(prompt(3)), layout=layout_pb(other))
        with pytest.raises(grpc.RpcError) as e:
            list(stub(address).FetchBlocks(request, metadata=call_credentials(TOKEN), timeout=10))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "layout" in e.value.details()
        request.layout.CopyFrom(layout_pb(layout))
        with pytest.raises(grpc.RpcError) as e:
            list(stub(address).FetchBlocks(request, timeout=10))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        call = stub(address).FetchBlocks(request, metadata=call_credentials(TOKEN), timeout=10)
        offer = next(call)
        assert offer.num_blocks == BLOCKS and len(offer.ticket) == block_channel.TICKET_BYTES
        # the data port is a plain TCP port: a local user without the ticket gets no byte
        with create_connection(("127.0.0.1", offer.data_port), timeout=10) as stranger:
            stranger.sendall(bytes(block_channel.TICKET_BYTES))
            assert stranger.recv(1) == b""
        got = []
        end = time.monotonic() + 10
        with block_channel.connect("127.0.0.1", offer.data_port, offer.ticket, None, 10) as conn:
            for i in range(BLOCKS):
                buf = bytearray(layout.bytes_per_block)
                assert block_channel.recv_block(conn, i, memoryview(buf), end) is True
                got.append(bytes(buf))
        assert list(call) == [] and got == want
        with Client(a.socket, token=TOKEN) as kv:
            assert kv.stats()["live_leases"] == 0  # the pin ended with the stream


def test_a_dead_holder_is_a_miss_and_a_restarted_one_serves_again(tmp_path, token_file):
    with two_members(tmp_path, token_file) as c:
        a, b = c.members["a"], c.members["b"]
        store_random(a.socket, prompt(4))
        a.stop(signal.SIGKILL)
        assert cached_bytes(b.socket, prompt(4)) == []  # a miss, in time, not an error
        a2 = c.start_member("a", *tcp_flags(token_file, "a", again=True))
        want = store_random(a2.socket, prompt(5), seed=5)
        got = wait_for(lambda: (r := cached_bytes(b.socket, prompt(5))) and r,
                       timeout=30, what="b to fetch from the restarted a")
        assert got == want
        with Client(b.socket, token=TOKEN) as kv:
            st = kv.stats(check_integrity=True)
            assert st["integrity"] == "ok" and st["live_leases"] == 0


def test_a_holder_that_evicted_the_prefix_offers_nothing_and_the_requester_misses(
        tmp_path, token_file):
    """What the index says a holder has can be gone by the time it is asked: the holder
    offers only what its own Match pins (here nothing), and the requester misses cleanly."""
    with two_members(tmp_path, token_file) as c:
        a, b = c.members["a"].socket, c.members["b"].socket
        store_random(a, prompt(8))
        for head in range(20, 26):  # 6 x 12 blocks through a 64-block pool: prompt 8 goes
            store_random(a, prompt(head), seed=head)
        assert cached_bytes(a, prompt(8)) == []
        with Client(a, token=TOKEN) as kv:
            layout = kv.pool_info().layout
        request = pb.FetchBlocksRequest(client_id="t", namespace=NS, layout=layout_pb(layout),
                                        tokens=to_token_bytes(prompt(8)))
        offers = list(stub(ADDRESSES["a"]).FetchBlocks(
            request, metadata=call_credentials(TOKEN), timeout=10))
        assert [o.num_blocks for o in offers] == [0]
        assert cached_bytes(b, prompt(8)) == []  # a miss, not an error
        want = cached_bytes(a, prompt(25))  # what a still holds is fetched as ever
        assert wait_for(lambda: cached_bytes(b, prompt(25)) == want, timeout=30,
                        what="b to fetch what a holds")
        for s in (a, b):
            with Client(s, token=TOKEN) as kv:
                st = kv.stats(check_integrity=True)
                assert st["integrity"] == "ok" and st["live_leases"] == 0


@pytest.mark.parametrize("fault", ["timeout", "sigkill"])
def test_a_holder_that_stalls_or_dies_mid_transfer_gives_the_verified_leading_run(
        tmp_path, token_file, fault):
    """The holder sends blocks 0-5 and stalls before block 6: b's Match answers within its
    --peer-fetch-timeout (or as soon as the holder is killed) with the six verified blocks."""
    import threading

    from radixkv.server.peer_source import STALL_BLOCK_ENV

    with two_members(tmp_path, token_file, "--peer-fetch-timeout",
                     "1" if fault == "timeout" else "60", env={STALL_BLOCK_ENV: "6"}) as c:
        a, b = c.members["a"], c.members["b"]
        tokens = prompt(6)
        want = store_random(a.socket, tokens, seed=6)
        store_random(a.socket, prompt(8, 5))  # stored after: once b has it, b knows prompt 6
        wait_for(lambda: cached_bytes(b.socket, prompt(8, 5)), what="b to learn what a holds")
        if fault == "sigkill":
            threading.Timer(1.0, a.stop, (signal.SIGKILL,)).start()
        start = time.monotonic()
        got = cached_bytes(b.socket, tokens)
        assert time.monotonic() - start < 30  # not the holder's stall: the timeout or the kill
        assert got == want[:6]
        assert peers(b.socket)["a"]["failures"] == 1 and peers(b.socket)["a"]["blocks_in"] == 11
        with Client(b.socket, token=TOKEN) as kv:
            st = kv.stats(check_integrity=True)
            assert st["integrity"] == "ok" and st["live_leases"] == 0


def wait_known(a: str, b: str) -> None:
    """Store a short prompt on a after what the test stored, and wait until b fetches it:
    b's index then holds everything a stored before."""
    store_random(a, prompt(99, 5), seed=99)
    wait_for(lambda: cached_bytes(b, prompt(99, 5)), what="b to learn what a holds")


def test_an_async_match_says_fetching_and_the_next_one_hits(tmp_path, token_file):
    with two_members(tmp_path, token_file) as c:
        a, b = c.members["a"].socket, c.members["b"].socket
        want = store_random(a, prompt(9), seed=9)
        wait_known(a, b)
        with Client(b, token=TOKEN) as kv:
            first = kv.match(NS, prompt(9), peer_fetch_async=True)
            kv.release(first.lease_id)
            assert first.fetching and first.num_tokens == 0  # answered at once, nothing yet

            def hit() -> list[int] | None:
                m = kv.match(NS, prompt(9), peer_fetch_async=True)
                kv.release(m.lease_id)
                return None if m.fetching else list(m.block_ids)
            ids = wait_for(hit, what="the background fetch")
            assert [bytes(kv.pool_of(first.epoch).block_bytes(i)) for i in ids] == want
            assert kv.stats()["live_leases"] == 0


def test_the_vllm_scheduler_asks_again_while_its_member_fetches(tmp_path, token_file,
                                                                monkeypatch):
    """The connector's scheduler side on b: `None` (vLLM's "ask again next step") while b pulls
    the prompt from a, then the whole prefix; the scheduler thread never waits on a."""
    from types import SimpleNamespace

    from kvpool.layout import KVLayout
    from radixkv.integrations.link import Link
    from radixkv.integrations.vllm.scheduler import SchedulerSide, check_layout
    from radixkv.integrations.vllm.stats import Stats

    monkeypatch.setenv("RADIXKV_AUTH_TOKEN", TOKEN)
    engine = KVLayout(2, 2, 8, "fp32", BLOCK_SIZE)  # the tiny layout's
    with two_members(tmp_path, token_file) as c:
        a, b = c.members["a"].socket, c.members["b"].socket
        store_random(a, prompt(10), seed=10)
        wait_known(a, b)
        link = Link(b, "vllm-b", check=lambda cl: check_layout(cl, engine, "flags"), retry_s=0)
        assert link.start()
        side = SchedulerSide(link, "chat@rev1", BLOCK_SIZE, 60.0, Stats(None))
        req = SimpleNamespace(request_id="r1", all_token_ids=prompt(10) + [7])
        try:
            answers = [side.matched(req, 0)]
            while answers[-1] is None and len(answers) < 200:
                time.sleep(0.02)
                answers.append(side.matched(req, 0))
            assert answers[0] is None and answers[-1] == BLOCKS * BLOCK_SIZE
            side.after_alloc(req, list(range(BLOCKS)), 0)  # vLLM took none: lease released
        finally:
            link.close()
        with Client(b, token=TOKEN) as kv:
            assert kv.stats()["live_leases"] == 0
