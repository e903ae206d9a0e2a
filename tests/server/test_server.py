"""The real service in a subprocess on a temporary Unix socket, driven through the client."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time

import grpc
import pytest
from _server import running_server
from _workers import hold_lease_then_hang, random_traffic, read_prompt, write_prompt

from radixkv.client import Client
from radixkv.protocol import errors
from radixkv.protocol.errors import RadixKVError

SPAWN = mp.get_context("spawn")


def in_process(fn, *args):
    """Run fn(*args) in a fresh spawned process and return its result."""
    with SPAWN.Pool(1) as pool:
        return pool.apply(fn, args)


@pytest.fixture(scope="module")
def server():
    with running_server(num_blocks=16) as s:
        yield s


@pytest.fixture
def kv(server):
    with Client(server.socket) as c:
        yield c
        stats = c.stats(check_integrity=True)
        assert stats["integrity"] == "ok", stats["integrity"]
        assert stats["live_leases"] == 0, "a test left a lease open"


def test_socket_is_private_and_health_serving(server, kv):
    mode = stat.S_IMODE(os.stat(server.socket).st_mode)
    assert mode & 0o077 == 0, oct(mode)
    assert kv.health() == "SERVING"
    assert kv.health("radixkv.v1.RadixKV") == "SERVING"


def test_reflection_lists_services(server):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(f"unix://{server.socket}") as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        req = reflection_pb2.ServerReflectionRequest(list_services="")
        resp = next(stub.ServerReflectionInfo(iter([req]), timeout=10))
    names = {s.name for s in resp.list_services_response.service}
    assert {"radixkv.v1.RadixKV", "grpc.health.v1.Health"} <= names


def test_pool_info(kv):
    info = kv.pool_info()
    assert info.handle.backend == "host"
    assert info.handle.num_blocks == 16
    assert info.layout.block_size == 4
    assert info.layout.bytes_per_block == 1024
    assert len(info.epoch) >= 8


def test_two_processes_share_kv_bytes(server, kv):
    """A writes KV for a prompt; B matches it (and a longer prompt) and reads A's bytes."""
    ns = "e2e"
    prompt = list(range(100, 110))  # 10 tokens: 2 full blocks + a partial one
    a = in_process(write_prompt, server.socket, ns, prompt)
    assert a["matched"] == 0 and len(a["new"]) == 2 and a["adopted"] == a["new"]
    b = in_process(read_prompt, server.socket, ns, prompt)
    assert b["matched"] == 8 and b["block_ids"] == a["new"] and b["ok"] == [True, True]
    longer = prompt[:8] + [7, 7, 7, 7, 7]
    c = in_process(write_prompt, server.socket, ns, longer)
    assert c["matched"] == 8 and len(c["new"]) == 1
    d = in_process(read_prompt, server.socket, ns, longer)
    assert d["matched"] == 12 and d["ok"] == [True, True, True]
    assert d["block_ids"] == a["new"] + c["new"]


def test_namespaces_never_share(kv):
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    for ns in ("tenant-a", "tenant-b"):
        with kv.lease(ns, tokens) as lease:
            assert lease.num_tokens == 0
            ids = lease.allocate(2)
            lease.insert(tokens, ids)
    with kv.lease("tenant-a", tokens) as a, kv.lease("tenant-b", tokens) as b:
        assert a.num_tokens == b.num_tokens == 8
        assert set(a.block_ids).isdisjoint(b.block_ids)
    spaces = {n["namespace"]: n for n in kv.stats()["namespaces"]}
    assert spaces["tenant-a"]["hit_tokens"] == 8 and spaces["tenant-b"]["hit_tokens"] == 8


def test_insert_adopts_only_new_prefix(kv):
    tokens = [9, 9, 9, 9, 8, 8, 8, 8]
    with kv.lease("adopt", tokens) as first:
        ids = first.allocate(2)
        assert first.insert(tokens, ids).adopted == ids
    # a second engine computed the same prompt concurrently: its blocks are duplicates
    with kv.lease("adopt", [5, 5, 5, 5]) as other:
        dup = other.allocate(2)
        r = kv.insert("adopt", tokens, dup, other.lease_id)
        assert r.adopted == () and r.duplicates == dup and r.num_cached_tokens == 8


def test_bad_input_gets_exact_status_and_server_survives():
    with running_server(num_blocks=16) as server, Client(server.socket) as kv:
        check_bad_input(server, kv)
        stats = kv.stats(check_integrity=True)
        assert stats["integrity"] == "ok" and stats["live_leases"] == 0
        assert stats["free_blocks"] + stats["cached_blocks"] == 16


def check_bad_input(server, kv):
    ns = "bad"
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]

    def code_of(call) -> str:
        with pytest.raises(RadixKVError) as info:
            call()
        return info.value.code

    assert code_of(lambda: kv.match(ns, [])) == "INVALID_ARGUMENT"
    assert code_of(lambda: kv.match("", tokens)) == "INVALID_ARGUMENT"
    assert code_of(lambda: kv.match(ns, b"\x01\x02\x03")) == "INVALID_ARGUMENT"
    assert code_of(lambda: kv.allocate(1, lease_id=12345)) == "NOT_FOUND"
    assert code_of(lambda: kv.release(12345)) == "NOT_FOUND"
    assert code_of(lambda: kv.allocate(17, namespace=ns)) == "INVALID_ARGUMENT"
    assert code_of(lambda: kv.dump_tree("no-such-namespace")) == "NOT_FOUND"
    with kv.lease(ns, tokens) as lease:
        ids = lease.allocate(2)
        # block count not matching the tokens
        assert code_of(lambda: lease.insert(tokens, ids[:1])) == "INVALID_ARGUMENT"
        # block ids out of range
        assert code_of(lambda: lease.insert(tokens, (ids[0], 99))) == "INVALID_ARGUMENT"
        # wrong namespace for the lease
        assert code_of(lambda: kv.insert("other", tokens, ids, lease.lease_id)) == \
            "PERMISSION_DENIED"
        # a lease of another client
        with Client(server.socket) as stranger:
            assert code_of(lambda: stranger.allocate(1, lease_id=lease.lease_id)) == \
                "PERMISSION_DENIED"
            assert code_of(lambda: stranger.release(lease.lease_id)) == "PERMISSION_DENIED"
        # blocks not owned by the lease (free ones)
        assert ids == (0, 1)
        free_block = 5
        with kv.lease(ns, [3, 3, 3, 3]) as other:
            assert code_of(lambda: kv.insert(ns, [3, 3, 3, 3], [ids[0]], other.lease_id)) == \
                "PERMISSION_DENIED"
            assert code_of(lambda: kv.insert(ns, [3, 3, 3, 3], [free_block],
                                             other.lease_id)) == "PERMISSION_DENIED"
        lease.insert(tokens, ids)
        # blocks already in the tree, under another prefix
        with kv.lease(ns, [4, 4, 4, 4]) as other:
            assert code_of(lambda: kv.insert(ns, [4, 4, 4, 4], [ids[1]], other.lease_id)) == \
                "ALREADY_EXISTS"
    # everything is still consistent and served
    assert kv.health() == "SERVING"
    with kv.lease(ns, tokens) as again:
        assert again.num_tokens == 8


def test_limits_vocab_and_message_size():
    with running_server("--vocab-size", "1000", "--max-tokens", "64",
                        "--max-message-bytes", "65536") as s, Client(s.socket) as kv:
        with pytest.raises(errors.InvalidArgument, match="token id 5000 at index 2"):
            kv.match("ns", [1, 2, 5000, 4])
        with pytest.raises(errors.InvalidArgument, match="65 tokens, limit 64"):
            kv.match("ns", list(range(65)))
        with pytest.raises(RadixKVError) as info:
            kv.match("ns", list(range(30000)))  # 120 kB > 64 KiB
        assert info.value.code == "RESOURCE_EXHAUSTED"
        assert kv.health() == "SERVING"
        assert kv.match("ns", [1, 2, 3, 4]).num_tokens == 0
        kv.release(*[r.lease_id for r in kv.match_many([("ns", [1])] * 3)])
        assert kv.stats(check_integrity=True)["integrity"] == "ok"


def test_pool_exhaustion_when_everything_is_pinned():
    with running_server(num_blocks=4) as s, Client(s.socket) as kv:
        with kv.lease("ns", list(range(16))) as lease:
            ids = lease.allocate(4)
            lease.insert(list(range(16)), ids)  # cached and pinned by this lease
            with pytest.raises(errors.OutOfBlocks, match="asked 1 blocks: 0 free, 0 evictable"):
                kv.allocate(1, namespace="ns")
        # released: now evictable, the allocation evicts the LRU leaf
        r = kv.allocate(1, namespace="ns")
        assert r.num_evicted == 1
        kv.release(r.lease_id)
        stats = kv.stats(check_integrity=True)
        assert stats["integrity"] == "ok" and stats["evicted_blocks"] == 1


def test_lease_expiry_and_killed_client():
    with running_server(num_blocks=16, lease_ttl=0.6) as s, Client(s.socket) as kv:
        tokens = list(range(8))
        with kv.lease("ns", tokens) as lease:
            lease.insert(tokens, lease.allocate(2))
        stale = kv.match("ns", tokens)  # pins 2 cached blocks
        extra = kv.allocate(3, lease_id=stale.lease_id)  # and leases 3 more
        assert kv.stats()["pinned_blocks"] == 2 and kv.stats()["leased_blocks"] == 3
        time.sleep(1.5)
        stats = kv.stats(check_integrity=True)
        assert stats["pinned_blocks"] == 0 and stats["leased_blocks"] == 0
        assert stats["free_blocks"] == 14 and stats["expired_leases"] == 1
        with pytest.raises(errors.LeaseExpired, match="expired"):
            kv.insert("ns", tokens, extra.block_ids[:2], stale.lease_id)

        # an engine SIGKILLed mid-lease pins nothing after the TTL
        ready = os.path.join(os.path.dirname(s.socket), "ready")
        proc = SPAWN.Process(target=hold_lease_then_hang, args=(s.socket, "ns", tokens, ready))
        proc.start()
        deadline = time.monotonic() + 30
        while not os.path.exists(ready) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert kv.stats()["pinned_blocks"] == 2
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        time.sleep(1.5)
        stats = kv.stats(check_integrity=True)
        assert stats["integrity"] == "ok"
        assert stats["pinned_blocks"] == 0 and stats["leased_blocks"] == 0
        assert stats["free_blocks"] + stats["cached_blocks"] == 16


def test_eight_clients_random_traffic_keep_integrity():
    with running_server(num_blocks=24, lease_ttl=5) as s:
        with SPAWN.Pool(8) as pool:
            results = pool.starmap(random_traffic, [(s.socket, seed, 3.0) for seed in range(8)])
        assert sum(r["requests"] for r in results) > 50
        assert sum(r["errors"] for r in results) == 0
        with Client(s.socket) as kv:
            stats = kv.stats(check_integrity=True)
            assert stats["integrity"] == "ok"
            assert stats["live_leases"] == 0
            assert stats["free_blocks"] + stats["cached_blocks"] == 24
            assert stats["requests"] == sum(r["requests"] for r in results)


def test_restart_changes_epoch_and_client_reattaches():
    sock = os.path.join(tempfile.mkdtemp(prefix="rkv-"), "s.sock")
    with running_server(socket_path=sock):
        kv = Client(sock)
        first = kv.pool()
        epoch = kv.pool_info().epoch
        assert kv.check_epoch() is False
        engine = Client(sock)  # notices restarts from Match answers alone
        engine_first = engine.pool()
    with running_server(socket_path=sock):
        m = engine.match("ns", [1, 2, 3, 4])
        assert engine.restarts == 1 and engine.pool() is not engine_first
        engine.release(m.lease_id)
        engine.close()
        assert kv.check_epoch() is True  # same socket, new service start
        assert kv.pool_info().epoch != epoch
        second = kv.pool()
        assert second is not first
        m = kv.match("ns", [1, 2, 3, 4])
        assert m.num_tokens == 0
        kv.release(m.lease_id)
    kv.close()
    os.rmdir(os.path.dirname(sock))


def test_second_server_on_same_socket_is_refused(server):
    out = subprocess.run([sys.executable, "-m", "radixkv", "serve", "--socket", server.socket,
                          "--num-blocks", "4", "--preset", "llama-3.2-1b"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "another radixkv server holds" in out.stderr
    assert server.alive()


def test_clear_command_frees_a_namespace(server, kv):
    tokens = [11, 12, 13, 14]
    with kv.lease("clear-me", tokens) as lease:
        lease.insert(tokens, lease.allocate(1))
        busy = subprocess.run([sys.executable, "-m", "radixkv", "clear", "clear-me",
                               "--socket", server.socket], capture_output=True, text=True)
        assert busy.returncode == 2 and "live lease" in busy.stderr
    out = subprocess.run([sys.executable, "-m", "radixkv", "clear", "clear-me", "--socket",
                          server.socket, "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"namespace": "clear-me", "num_freed": 1}
    with pytest.raises(errors.NotFound):
        kv.dump_tree("clear-me")


def test_serve_with_no_arguments_answers_health_and_reflection(monkeypatch):
    """`radixkv serve` alone: host pool, default layout, the socket from $RADIXKV_SOCKET."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    directory = tempfile.mkdtemp(prefix="rkv-")
    sock = os.path.join(directory, "default.sock")
    monkeypatch.setenv("RADIXKV_SOCKET", sock)
    proc = subprocess.Popen([sys.executable, "-m", "radixkv", "serve"], text=True,
                            stdout=subprocess.PIPE)
    try:
        banner = proc.stdout.readline()
        assert banner.startswith(f"radixkv serving on unix://{sock}: host pool, 1024 blocks")
        with Client() as kv:  # the client resolves the same default
            assert kv.health() == "SERVING"
            assert kv.pool_info().handle.backend == "host"
        with grpc.insecure_channel(f"unix://{sock}") as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            req = reflection_pb2.ServerReflectionRequest(
                file_containing_symbol="radixkv.v1.RadixKV")
            resp = next(stub.ServerReflectionInfo(iter([req]), timeout=10))
        assert resp.file_descriptor_response.file_descriptor_proto
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    assert not os.path.exists(sock)
    os.rmdir(directory)


def test_lease_ttl_from_the_environment(monkeypatch):
    """$RADIXKV_LEASE_TTL sets the TTL when --lease-ttl is not given."""
    directory = tempfile.mkdtemp(prefix="rkv-")
    sock = os.path.join(directory, "ttl.sock")
    monkeypatch.setenv("RADIXKV_LEASE_TTL", "0.3")
    proc = subprocess.Popen([sys.executable, "-m", "radixkv", "serve", "--socket", sock,
                             "--num-blocks", "8"], text=True, stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().startswith("radixkv serving on")
        with Client(sock) as kv:
            kv.allocate(2, namespace="ns")
            deadline = time.monotonic() + 10
            while kv.stats()["expired_leases"] == 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            stats = kv.stats()
        assert stats["expired_leases"] == 1 and stats["free_blocks"] == 8
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    os.rmdir(directory)


def test_event_subscribers_do_not_starve_calls():
    """Streams run on their own threads: more subscribers than call threads, calls still flow."""
    from radixkv.v1 import radixkv_pb2 as pb

    with running_server("--workers", "1", "--stream-workers", "4") as s:
        subscribers = [Client(s.socket) for _ in range(3)]
        # raw stubs: the calls start now, not on the first next()
        streams = [c._stub.Events(pb.EventsRequest(), timeout=30) for c in subscribers]
        time.sleep(0.5)  # let every stream reach the server and park on its thread
        with Client(s.socket, timeout=5) as kv:
            tokens = [5, 6, 7, 8]
            with kv.lease("busy", tokens) as lease:
                lease.insert(tokens, lease.allocate(1))
        got = [next(stream) for stream in streams]  # every subscriber sees the insert
        assert [list(e.stored.block_ids) for e in got] == [[0], [0], [0]]
        for stream in streams:
            stream.cancel()
        for c in subscribers:
            c.close()


def test_serve_cpus_pins_every_thread_and_refuses_a_cpu_it_may_not_use():
    """`serve --cpus N`: the server and every thread it started (grpc's included) run on CPU
    N only, and it still serves; a CPU outside this process's set is refused at start."""
    cpu = max(os.sched_getaffinity(0))
    with running_server("--cpus", str(cpu)) as server:
        pid = server.proc.pid
        threads = os.listdir(f"/proc/{pid}/task")
        assert len(threads) > 3  # grpc's and the service's threads, started after pinning
        assert all(os.sched_getaffinity(int(t)) == {cpu} for t in threads)
        with Client(server.socket) as kv:
            m = kv.match("ns", [1, 2, 3, 4])
            kv.release(m.lease_id)
    bad = max(os.sched_getaffinity(0)) + 1
    out = subprocess.run([sys.executable, "-m", "radixkv", "serve", "--cpus", f"0,{bad}"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and f"--cpus '0,{bad}'" in out.stderr
    assert "may use CPUs" in out.stderr
    out = subprocess.run([sys.executable, "-m", "radixkv", "serve", "--cpus", "x"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "CPU numbers and ranges" in out.stderr
