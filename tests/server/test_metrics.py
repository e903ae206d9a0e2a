"""The Prometheus endpoint of a real server: counters and gauges match scripted traffic exactly."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from _server import REPO, running_server, tiny_config_path
from prometheus_client.parser import text_string_to_metric_families

from radixkv.client import Client
from radixkv.protocol import errors

A1 = list(range(1, 9))
A2 = A1 + [9, 10, 11, 12]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def request(kv: Client, ns: str, tokens: list[int]) -> None:
    with kv.lease(ns, tokens, store_tokens=0) as lease:  # the four-call path
        new = lease.allocate(len(tokens) // 4 - lease.num_tokens // 4)
        lease.insert(tokens, lease.block_ids + new)


def test_metrics_match_scripted_traffic(tmp_path):
    port = free_port()
    with running_server("--metrics-port", str(port), num_blocks=4, lease_ttl=0.5) as s, \
            Client(s.socket) as kv:
        request(kv, "a", A1)  # queries 8, hits 0; blocks 0 1
        request(kv, "a", A2)  # queries 12, hits 8; block 2
        request(kv, "b", A1)  # queries 8, hits 0; evicts a's block 2
        with pytest.raises(errors.NotFound):
            kv.release(12345)
        with pytest.raises(errors.InvalidArgument):
            kv.match("", A1)  # rejected before counting
        with pytest.raises(errors.InvalidArgument):
            kv.allocate(5, namespace="a")
        held = kv.match("a", A1)  # queries 8, hits 8; pins a's blocks 0 1
        kv.allocate(1, lease_id=held.lease_id)  # evicts b's tail block (b is the LRU namespace)

        m = scrape(port)

        def one(name: str, **labels: str) -> float:
            return m[(name, frozenset(labels.items()))]

        assert one("radixkv_prefix_cache_queries_total") == 36
        assert one("radixkv_prefix_cache_hits_total") == 16
        assert one("radixkv_prefix_cache_requests_total") == 4
        assert {st: one("radixkv_blocks", state=st)
                for st in ("free", "leased", "cached", "pinned")} == \
            {"free": 0, "leased": 1, "cached": 1, "pinned": 2}
        assert one("radixkv_pool_blocks") == 4 and one("radixkv_pool_block_bytes") == 1024
        assert one("radixkv_evicted_blocks_total") == 2
        assert one("radixkv_leases") == 1 and one("radixkv_expired_leases_total") == 0
        assert one("radixkv_namespaces") == 2 and one("radixkv_events_total") == 5
        assert one("radixkv_uptime_seconds") > 0
        calls = {n: one("radixkv_rpc_duration_seconds_count", method=n)
                 for n in ("PoolInfo", "Match", "Allocate", "Insert", "Release", "Stats",
                           "DumpTree")}
        assert calls == {"PoolInfo": 0, "Match": 5, "Allocate": 5, "Insert": 3, "Release": 4,
                         "Stats": 0, "DumpTree": 0}
        assert one("radixkv_rpc_duration_seconds_bucket", method="Match", le="+Inf") == 5
        errs = {(dict(k[1])["method"], dict(k[1])["code"]): v for k, v in m.items()
                if k[0] == "radixkv_rpc_errors_total"}
        assert errs == {("Release", "NOT_FOUND"): 1, ("Match", "INVALID_ARGUMENT"): 1,
                        ("Allocate", "INVALID_ARGUMENT"): 1}

        # the held lease runs past its 0.5 s TTL: the sweeper ends it
        deadline = time.monotonic() + 10
        while one("radixkv_expired_leases_total") == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
            m = scrape(port)
        assert one("radixkv_expired_leases_total") == 1 and one("radixkv_leases") == 0
        assert {st: one("radixkv_blocks", state=st)
                for st in ("free", "leased", "cached", "pinned")} == \
            {"free": 1, "leased": 0, "cached": 3, "pinned": 0}

        # the port is taken: a second server says so and exits 2
        out = subprocess.run([sys.executable, "-m", "radixkv", "serve", "--socket",
                              str(tmp_path / "s.sock"), "--model-config",
                              tiny_config_path(str(tmp_path)), "--metrics-port", str(port)],
                             capture_output=True, text=True, timeout=60, cwd=REPO)
        assert out.returncode == 2, out.stderr
        assert f"cannot serve metrics on 127.0.0.1:{port}" in out.stderr



def test_window_parts_on_a_windowed_pool():
    port = free_port()
    with running_server("--metrics-port", str(port), "--sliding-window", "9",
                        "--window-layers", "0", "--num-window-blocks", "6",
                        num_blocks=8) as s, Client(s.socket) as kv:
        with kv.lease("ns", list(range(20))) as lease:  # 5 blocks: 2 window parts (the tail)
            m = scrape(port)

            def one(name: str, **labels: str) -> float:
                return m[(name, frozenset(labels.items()))]

            assert {st: one("radixkv_blocks", state=st)
                    for st in ("free", "leased", "cached", "pinned")} == {
                "free": 3, "leased": 5, "cached": 0, "pinned": 0}
            assert {st: one("radixkv_window_parts", state=st)
                    for st in ("free", "leased", "cached")} == {
                "free": 4, "leased": 2, "cached": 0}
            assert lease.new_window_ids
