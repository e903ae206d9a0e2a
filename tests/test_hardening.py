"""Faults found by trying the service as a hostile user and as an operator would: each test
failed before its fix. Numbers refer to the hardening issue's list."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import pytest
from _kv import fill, make_service, toks
from _server import running_server, tiny_config_path

from radixkv import errors
from radixkv.client import Client
from radixkv.server.launch import start_server

# ---- leases and accounting ------------------------------------------------------------------


def test_1_failed_allocate_leaves_no_lease(svc):
    held = svc.match("e", "ns", toks(*range(32)))  # nothing cached; now fill the pool
    svc.allocate("e", held.lease_id, "ns", 8)
    before = svc.stats().live_leases
    with pytest.raises(errors.OutOfBlocks):
        svc.allocate("other", None, "ns2", 1)
    assert svc.stats().live_leases == before
    assert "ns2" not in svc.namespaces()


def test_2_failed_match_batch_changes_nothing(clock):
    svc = make_service(clock, max_namespaces=2)
    fill(svc, "a", toks(*range(8)))
    with pytest.raises(errors.LimitExceeded, match="namespaces"):
        svc.match_many("e", [("a", toks(*range(8))), ("b", toks(1)), ("c", toks(2))])
    s = svc.stats()
    assert (s.live_leases, s.pinned_blocks, s.requests) == (0, 0, 1)
    assert svc.namespaces() == ["a"]
    svc.check_integrity()


def test_3_insert_batch_is_all_or_nothing(svc):
    m1, m2 = svc.match_many("e", [("ns", toks(*range(8))), ("ns", toks(*range(100, 108)))])
    ids1 = svc.allocate("e", m1.lease_id, "ns", 2).block_ids
    ids2 = svc.allocate("e", m2.lease_id, "ns", 2).block_ids
    bad = (ids2[0], 7)  # block 7 was never allocated to m2
    with pytest.raises(errors.PermissionDenied, match="block 7 is not allocated"):
        svc.insert_many("e", [(m1.lease_id, "ns", toks(*range(8)), ids1),
                              (m2.lease_id, "ns", toks(*range(100, 108)), bad)])
    assert svc.stats().cached_blocks == 0  # item 1 was not committed either
    with pytest.raises(errors.InvalidArgument, match="claimed by two items"):
        svc.insert_many("e", [(m1.lease_id, "ns", toks(*range(8)), ids1),
                              (m1.lease_id, "ns", toks(*range(200, 208)), ids1)])
    assert svc.stats().cached_blocks == 0
    out, _ = svc.insert_many("e", [(m1.lease_id, "ns", toks(*range(8)), ids1),
                                   (m2.lease_id, "ns", toks(*range(100, 108)), ids2)])
    assert [r.adopted for r in out] == [ids1, ids2]


def test_4_empty_namespaces_are_reclaimed(clock):
    svc = make_service(clock, max_namespaces=4)
    for i in range(50):  # far more distinct names than the limit: each one goes when idle
        m = svc.match("e", f"ns{i}", toks(1, 2, 3, 4))
        svc.release("e", [m.lease_id])
    assert svc.namespaces() == []
    held = [svc.match("e", f"x{i}", toks(1)).lease_id for i in range(4)]
    with pytest.raises(errors.LimitExceeded, match="4 namespaces hold blocks or leases"):
        svc.match("e", "one-too-many", toks(1))
    svc.release("e", held)
    svc.check_integrity()


def test_5_clear_keeps_lifetime_counters(svc):
    fill(svc, "ns", toks(*range(8)))
    fill(svc, "ns", toks(*range(8)))  # a hit of 8 tokens
    before = svc.stats()
    assert svc.clear("ns") == 2
    after = svc.stats()
    assert (after.requests, after.query_tokens, after.hit_tokens) == (
        before.requests, before.query_tokens, before.hit_tokens) == (2, 16, 8)


def test_6_keep_alive_and_per_call_ttl(svc, clock):
    m = svc.match("e", "ns", toks(*range(8)), ttl_s=100)
    clock.now += 50  # past the default 10 s, within the asked 100 s
    svc.expire_leases()
    ids = svc.allocate("e", m.lease_id, "ns", 2).block_ids
    for _ in range(5):  # an engine renewing during a long forward pass
        clock.now += 90
        assert svc.keep_alive("e", [m.lease_id]) == 100
        svc.expire_leases()
    svc.insert("e", m.lease_id, "ns", toks(*range(8)), ids)
    with pytest.raises(errors.InvalidArgument, match="cap"):
        svc.match("e", "ns", toks(1), ttl_s=10**9)
    with pytest.raises(errors.InvalidArgument, match="cap"):
        svc.keep_alive("e", [m.lease_id], ttl_s=-1)
    svc.release("e", [m.lease_id])


def test_6_keep_alive_over_grpc():
    with running_server(lease_ttl=0.5) as s, Client(s.socket) as kv:
        assert kv.pool_info().lease_ttl_s == 0.5
        with kv.lease("ns", list(range(8))) as lease:
            for _ in range(6):
                time.sleep(0.2)
                assert lease.keep_alive() == pytest.approx(0.5)
            assert lease.allocate(2)  # still alive after 1.2 s
        long = kv.match("ns", [1, 2, 3, 4], ttl=5)
        time.sleep(1.0)
        kv.release(long.lease_id)  # alive: its own TTL was 5 s


# ---- restart and stale state ------------------------------------------------------------------


def test_7_events_refuse_a_resume_across_epochs():
    with tempfile.TemporaryDirectory(prefix="rkv-") as d:
        sock = os.path.join(d, "s.sock")
        with running_server(socket_path=sock) as s, Client(s.socket) as kv:
            old = kv.pool_info().epoch
            with kv.lease("ns", [1, 2, 3, 4]) as lease:
                lease.insert([1, 2, 3, 4], lease.allocate(1))
            first = next(iter(kv.events(from_sequence=1, timeout=5)))
            assert first.epoch == old
        with running_server(socket_path=sock) as s, Client(s.socket) as kv:
            with pytest.raises(errors.StalePool, match="restarted"):
                list(kv.events(from_sequence=2, epoch=old, timeout=5))
            new = kv.pool_info().epoch
            assert list(kv.events(epoch=new, timeout=0.3)) == []


def test_8_restart_between_allocate_and_insert_caches_nothing():
    with tempfile.TemporaryDirectory(prefix="rkv-") as d:
        sock, cfg = os.path.join(d, "s.sock"), tiny_config_path(d)
        flags = ("--model-config", cfg, "--block-size", "4", "--num-blocks", "16")
        server = start_server(sock, *flags)
        try:
            with Client(sock) as kv:
                tokens = list(range(8))
                lease = kv.lease("ns", tokens)
                new = lease.allocate(2)
                view = lease.view()
                view[list(new)] = 7.0  # the engine writes KV into the old pool
                server.stop()
                server = start_server(sock, *flags)
                with pytest.raises(errors.StalePool, match="restarted"):
                    lease.insert(tokens, new)
                assert kv.stats()["cached_blocks"] == 0
                again = kv.lease("ns", tokens)  # a new Match: the client maps the new pool
                assert again.num_tokens == 0 and again.view().shape[0] == 16
                with pytest.raises(errors.StalePool, match="match the prompt again"):
                    lease.view()  # the old lease's ids never meet the new mapping
                again.release()
        finally:
            assert server.stop() == 0


def test_8_insert_with_an_old_epoch_is_refused():
    with running_server() as s, Client(s.socket) as kv:
        m = kv.match("ns", list(range(8)))
        ids = kv.allocate(2, lease_id=m.lease_id).block_ids
        with pytest.raises(errors.StalePool):
            kv.insert("ns", list(range(8)), ids, m.lease_id, epoch="0" * 32)
        assert kv.insert("ns", list(range(8)), ids, m.lease_id, epoch=m.epoch).adopted == ids


def test_9_integrity_checks_hold_under_python_O():
    code = """
from gpu_pool import create_pool
from gpu_pool.layout import KVLayout
from radixkv.errors import IntegrityError
from radixkv.service import KVService
import numpy as np
svc = KVService(create_pool(KVLayout(1, 1, 4, "fp32", 4), num_blocks=8))
m = svc.match("e", "ns", np.arange(8, dtype="<u4").tobytes())
ids = svc.allocate("e", m.lease_id, "ns", 2).block_ids
svc.pool.free([ids[0]])  # corrupt: a leased block back on the free list
try:
    svc.check_integrity()
    print("missed")
except IntegrityError as e:
    print("caught", e)
svc.pool.close()
"""
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("caught free 7 + leased 2"), out.stdout


def test_9_stats_reports_a_failed_invariant(clock):
    from radixkv.server.servicer import Servicer
    from radixkv.v1 import radixkv_pb2 as pb

    svc = make_service(clock)
    servicer = Servicer(svc, 1 << 20)
    m = svc.match("e", "ns", toks(*range(8)))
    svc.pool.free([svc.allocate("e", m.lease_id, "ns", 1).block_ids[0]])  # corrupt the service
    resp = servicer.Stats(pb.StatsRequest(check_integrity=True), None)
    assert resp.integrity.startswith("FAILED: free 8 + leased 1")
    time.sleep(0.1)  # the next check is allowed after 10x the last one's time
    svc.pool._free.append(svc.pool._free[0])  # corrupt the pool's own free list
    resp = servicer.Stats(pb.StatsRequest(check_integrity=True), None)
    assert resp.integrity == "FAILED: free list holds 1 duplicate ids"
    svc.pool.close()


def test_10_engine_syncs_before_every_release(monkeypatch):
    pytest.importorskip("transformers")
    from radixkv.engines import tiny_llama
    from radixkv.engines.hf import Engine

    order: list[str] = []
    monkeypatch.setattr(Engine, "_sync", staticmethod(lambda view: order.append("sync")))
    real_release = Client.release
    monkeypatch.setattr(Client, "release",
                        lambda self, *ids: order.append("release") or real_release(self, *ids))
    with tempfile.TemporaryDirectory(prefix="rkv-hf-") as d, running_server(
            "--model-config", tiny_llama.write_config(d, "test"), num_blocks=64) as s:
        engine = Engine(tiny_llama.build_model("test", seed=0), s.socket, namespace="tiny")
        prompt = list(range(1, 14))
        engine.prefill(prompt)  # stores 3 blocks
        order.clear()
        engine.prefill(prompt)  # all cached: reads only, stores nothing
        assert order == ["sync", "release"]
        engine.close()


def test_11_pool_info_carries_the_owner_pid():
    with running_server() as s, Client(s.socket) as kv:
        assert kv.pool_info().handle.owner_pid == s.proc.pid


# ---- local security and input ---------------------------------------------------------------


def test_12_socket_directory_of_another_mode_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # as another local user could have prepared it
    with pytest.raises(errors.PermissionDenied, match="not writable by group or others"):
        Client(str(shared / "radixkv.sock"))
    out = subprocess.run([sys.executable, "-m", "radixkv", "serve", "--socket",
                          str(shared / "radixkv.sock"), "--model-config",
                          tiny_config_path(str(tmp_path))],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "not writable by group or others" in out.stderr


def test_12_lock_file_symlink_is_not_followed(tmp_path):
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (d / "s.sock.lock").symlink_to(victim)
    out = subprocess.run([sys.executable, "-m", "radixkv", "serve", "--socket",
                          str(d / "s.sock"), "--model-config", tiny_config_path(str(tmp_path))],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "lock file" in out.stderr
    assert victim.read_text() == "keep me"


@pytest.mark.parametrize("name", ["with space", "tab\there", "nl\n", "\x1b[31mred", "ünï",
                                  "x" * 257, ""])
def test_13_namespace_charset(svc, name):
    with pytest.raises(errors.InvalidArgument):
        svc.match("e", name, toks(1))


def test_13_inspector_escapes_what_it_prints():
    from rich.console import Console

    from radixkv.cli.inspector import event_line, markup_safe, render_summary

    assert event_line({"type": "AllBlocksCleared", "sequence": 1, "timestamp": 0,
                       "namespace": "a\x1b[2Jb"}).endswith("a\\x1b[2Jb AllBlocksCleared")
    d = {"target": "[red]t", "uptime_s": 1, "epoch": "e", "evicted_blocks": 0,
         "leases": {"live": 0, "expired": 0},
         "pool": {"backend": "host", "bytes": {"total": 1, "free": 1, "cached": 0},
                  "blocks": {"total": 1, "free": 1, "leased": 0, "cached": 0, "pinned": 0},
                  "layout": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1,
                             "dtype": "fp16", "block_size": 1, "bytes_per_block": 4}},
         "hit_rate": {"lifetime": {"requests": 0, "query_tokens": 0, "hit_tokens": 0,
                                   "rate": None}},
         "namespaces": [{"namespace": "[bold]ns", "cached_blocks": 0, "cached_tokens": 0,
                         "nodes": 0, "requests": 0, "hit_rate": None, "evicted_blocks": 0}]}
    console = Console(record=True, width=120)
    console.print(render_summary(d))
    text = console.export_text()
    assert "[red]t" in text and "[bold]ns" in text
    assert markup_safe("\x07[x]") == "\\x07\\[x]"


def test_14_leases_per_client_are_capped(clock):
    svc = make_service(clock, max_leases_per_client=3)
    held = [svc.match("greedy", "ns", toks(1)).lease_id for _ in range(3)]
    with pytest.raises(errors.LimitExceeded, match="holds 3 live leases"):
        svc.match_many("greedy", [("ns", toks(1))])
    with pytest.raises(errors.LimitExceeded):
        svc.allocate("greedy", None, "ns", 1)
    svc.release("other", [svc.match("other", "ns", toks(1)).lease_id])  # others unaffected
    svc.release("greedy", held)


def test_14_batch_sizes_and_integrity_rate_are_capped():
    with running_server() as s, Client(s.socket) as kv:
        assert kv.pool_info().max_batch == 4096
        with pytest.raises(errors.InvalidArgument, match="4097 in one call, limit 4096"):
            kv.match_many([("ns", [1])] * 4097)
        with pytest.raises(errors.InvalidArgument, match="limit 4096"):
            kv.release(*range(1, 4098))
        assert kv.stats()["live_leases"] == 0
        results = []
        for _ in range(50):  # back to back: never an error, at most a short wait
            results.append(kv.stats(check_integrity=True)["integrity"])
        assert set(results) == {"ok"}


@pytest.mark.parametrize("flag,value,message", [
    ("--policy", "nope", "invalid choice: 'nope'"),
    ("--lease-ttl", "0", "must be a positive number"),
    ("--workers", "0", "must be a positive integer"),
    ("--max-tokens", "-5", "must be a positive integer"),
])
def test_15_flags_are_checked_at_parse_time(tmp_path, flag, value, message):
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "radixkv", "serve", "--socket",
                          str(tmp_path / "s.sock"), flag, value],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert not (tmp_path / "s.sock").exists()
    assert time.monotonic() - start < 30
