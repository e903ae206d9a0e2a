"""radixkv as SGLang's HiCache storage backend, with SGLang's real HiCacheController (CPU, host
pool, stand-in device allocator) in worker processes run by .venv-sglang's python
(scripts/bootstrap_sglang; _sglang_worker.py) against a real radixkv server. The workers
start once for the module (SGLang imports take a while) and open controllers per test; radixkv
servers come and go per test, each on its own socket."""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from typing import Any

import pytest
from _server import running_server, tiny_config_path, wait_for
from _sglang_workers import (
    PAGE,
    Worker,
    leases_back_to,
    loaded_prefetch,
    no_errors,
    stored_write,
    tokens,
)

from radixkv.client import Client
from radixkv.server.launch import start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_two_workers_share_a_prefix(workers: dict[str, Worker], layout: str) -> None:
    a, b = workers["A"], workers["B"]
    with running_server(num_blocks=64) as server:
        ns = a("open", name=layout, layout=layout, socket=server.socket)["namespace"]
        assert ns == b("open", name=layout, layout=layout, socket=server.socket)["namespace"]
        shared = tokens(1000, 5)
        wrote = a("write", name=layout, tokens=shared, seed=7)
        assert wrote["stored"] == len(shared)
        longer = shared + tokens(5000, 3)
        got = b("prefetch", name=layout, tokens=longer)
        assert got["hit"] == got["loaded"] == len(shared)  # exactly A's pages
        assert got["pages"] == wrote["pages"]  # bytes equal to A's, in B's host slots
        s = leases_back_to(server.socket, 0)
        assert s["integrity"] == "ok" and s["expired_leases"] == 0
        (n,) = s["namespaces"]
        assert n["namespace"] == ns and n["key_size"] == 32 and n["cached_blocks"] == 5
    no_errors(a, b)


def test_leading_run_stops_at_an_evicted_middle_page(workers: dict[str, Worker]) -> None:
    a, b = workers["A"], workers["B"]
    with running_server(num_blocks=16) as server:
        a("open", name="gap", socket=server.socket)
        b("open", name="gap", socket=server.socket)
        seq = tokens(2000, 4)
        a("write", name="gap", tokens=seq, seed=3)
        keys = a("keys", name="gap", tokens=seq)["keys"]
        # a chain whose third page is missing: only pages 0 and 1 count, page 3 is never read
        assert b("exists", name="gap", keys=keys[:2] + [keys[3]] + [keys[2]])["exists"] == 2
        assert b("exists", name="gap", keys=keys[2:], prefix=keys[:2])["exists"] == 2
        b("clear", name="gap")  # evict the tail: a clear (B's held leases ended), then 0-1 again
        a("write", name="gap", tokens=seq[:2 * PAGE], seed=3)
        got = b("prefetch", name="gap", tokens=seq)
        assert got["hit"] == got["loaded"] == 2 * PAGE
    no_errors(a, b)


def matches(server: Any) -> int:
    """Match queries radixkv answered in the (one) namespace so far."""
    with Client(server.socket) as kv:
        (n,) = kv.stats()["namespaces"]
        return int(n["requests"])


def test_exists_reads_the_table_and_the_get_pins(workers: dict[str, Worker]) -> None:
    """batch_exists answers from radixkv's lookup table (no Match: the service counts none),
    the get that follows matches, pins and loads A's bytes; a page evicted between the exists
    and the get is not loaded (False), never another page's bytes."""
    a, b = workers["A"], workers["B"]
    with running_server(num_blocks=32) as server:
        a("open", name="table", socket=server.socket)
        namespace = b("open", name="table", socket=server.socket)["namespace"]
        seq = tokens(5000, 6)
        wrote = a("write", name="table", tokens=seq, seed=4)
        keys = a("keys", name="table", tokens=seq)["keys"]
        before = matches(server)
        assert b("exists", name="table", keys=keys[2:], prefix=keys[:2])["exists"] == 4
        assert matches(server) == before  # read from the table
        got = b("get", name="table", keys=keys[2:5], prefix=keys[:2])
        assert got["done"] == [True] * 3 and got["pages"] == wrote["pages"][2:5]
        assert matches(server) == before + 1  # the get's own Match
        assert b("exists", name="table", keys=keys)["exists"] == 6
        with Client(server.socket) as kv:  # evicted before the get
            leases_back_to(server.socket, 0)
            kv.clear(namespace)
        got = b("get", name="table", keys=keys)
        assert got["done"] == [False] * 6 and got["pages"] == []
        stats = b("stats", name="table")["stats"]
        assert stats["exists_table"] == 2 and stats["get_held_leases"] == 0
        s = leases_back_to(server.socket, 0)
        assert s["integrity"] == "ok" and s["expired_leases"] == 0
    no_errors(a, b)


def test_a_prefetch_gets_under_the_lease_of_its_exists(workers: dict[str, Worker]) -> None:
    """With `lookup: match`, SGLang's batch_exists then batch_get_v1 of (a leading part of) the
    same keys: one Match for both, A's bytes, and the lease released once, by the get."""
    a, b = workers["A"], workers["B"]
    with running_server(num_blocks=32) as server:
        a("open", name="held", socket=server.socket)
        b("open", name="held", socket=server.socket, extra={"lookup": "match"})
        seq = tokens(6000, 6)
        wrote = a("write", name="held", tokens=seq, seed=4)
        keys = a("keys", name="held", tokens=seq)["keys"]
        before = matches(server)
        assert b("exists", name="held", keys=keys[2:], prefix=keys[:2])["exists"] == 4
        got = b("get", name="held", keys=keys[2:5], prefix=keys[:2])
        assert got["done"] == [True] * 3 and got["pages"] == wrote["pages"][2:5]
        assert matches(server) == before + 1  # the get matched nothing itself
        s = leases_back_to(server.socket, 0)
        assert s["integrity"] == "ok" and s["expired_leases"] == 0
        got = b("prefetch", name="held", tokens=seq)  # through SGLang's controller
        assert got["loaded"] == len(seq) and got["pages"] == wrote["pages"]
        assert matches(server) == before + 2
        assert b("stats", name="held")["stats"]["get_held_leases"] == 2
    no_errors(a, b)


def test_a_get_of_other_keys_matches_afresh(workers: dict[str, Worker]) -> None:
    """A get whose keys are not those of the exists before it (another sequence; another
    prefix) matches them itself; the exists' lease ends once it is too old to use."""
    a, b = workers["A"], workers["B"]
    with running_server(num_blocks=32) as server:
        a("open", name="other", socket=server.socket)
        # 0.2 s is below radixkv's shortest TTL (1 s): the backend asks for 1 s
        b("open", name="other", socket=server.socket,
          extra={"exists_hold_s": 0.2, "lookup": "match"})
        one, two = tokens(7000, 3), tokens(8000, 3)
        a("write", name="other", tokens=one, seed=1)
        wrote = a("write", name="other", tokens=two, seed=2)
        k1 = a("keys", name="other", tokens=one)["keys"]
        k2 = a("keys", name="other", tokens=two)["keys"]
        assert b("exists", name="other", keys=k1)["exists"] == 3
        before = matches(server)
        got = b("get", name="other", keys=k2)
        assert got["done"] == [True] * 3 and got["pages"] == wrote["pages"]
        assert b("get", name="other", keys=k2[1:], prefix=k1[:1])["done"] == [False] * 2
        assert matches(server) == before + 2
        leases_back_to(server.socket, 1)  # the exists' lease, still held
        time.sleep(0.6)  # past half its 1 s: dropped at the next call, released
        assert b("get", name="other", keys=k1)["done"] == [True] * 3
        leases_back_to(server.socket, 0)
        assert b("stats", name="other")["stats"]["get_held_leases"] == 0
    no_errors(a, b)


def test_a_get_after_radixkv_restarted_loads_no_stale_page(workers: dict[str, Worker]) -> None:
    """radixkv restarts between batch_exists and batch_get_v1 (the exists' lease ended with
    its pool) and the keys are stored again with other bytes: the get loads nothing, or the
    new bytes, never the old pool's; the next prefetch loads the new bytes."""
    a, b = workers["A"], workers["B"]
    with tempfile.TemporaryDirectory(prefix="rkv-") as d:
        sock = os.path.join(d, "s.sock")
        seq = tokens(9000, 3)
        with running_server(num_blocks=32, socket_path=sock):
            a("open", name="restart", socket=sock, extra={"retry_s": 0.2})
            b("open", name="restart", socket=sock, extra={"retry_s": 0.2})
            old = stored_write(a, "restart", seq, seed=1)
            keys = a("keys", name="restart", tokens=seq)["keys"]
            wait_for(lambda: b("exists", name="restart", keys=keys)["exists"] == 3, timeout=10,
                     what="B to see A's pages")
        with running_server(num_blocks=32, socket_path=sock):
            new = stored_write(a, "restart", seq, seed=2)
            assert new["pages"] != old["pages"]
            got = b("get", name="restart", keys=keys)
            assert got["pages"] in ([], new["pages"])
            deadline = time.monotonic() + 10
            while (got := b("prefetch", name="restart", tokens=seq))["loaded"] == 0:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            assert got["pages"] == new["pages"]
    no_errors(a, b)


def test_eviction_under_a_small_pool(workers: dict[str, Worker]) -> None:
    a, b = workers["A"], workers["B"]
    with running_server(num_blocks=12) as server:
        a("open", name="small", socket=server.socket)
        b("open", name="small", socket=server.socket)
        written = {}
        for i in range(10):  # 40 pages through a 12-block pool
            seq = tokens(10_000 + 100 * i, 4)
            written[i] = a("write", name="small", tokens=seq, seed=i)
            assert written[i]["stored"] == len(seq)
        for i in (9, 8):
            got = b("prefetch", name="small", tokens=tokens(10_000 + 100 * i, 4))
            assert got["loaded"] == got["hit"]
            assert got["pages"] == written[i]["pages"][:got["loaded"] // PAGE]
        assert b("prefetch", name="small", tokens=tokens(10_000 + 900, 4))["loaded"] == 16
        with Client(server.socket) as kv:
            s = kv.stats(check_integrity=True)
            assert s["integrity"] == "ok" and s["evicted_blocks"] >= 28
    no_errors(a, b)


def test_tp_ranks_never_share(workers: dict[str, Worker]) -> None:
    a, b = workers["A"], workers["B"]
    with running_server(num_blocks=32) as server:
        ns0 = a("open", name="tp0", socket=server.socket, tp_rank=0, tp_size=2)["namespace"]
        ns1 = b("open", name="tp1", socket=server.socket, tp_rank=1, tp_size=2)["namespace"]
        assert ns0 != ns1 and "tp0of2" in ns0 and "tp1of2" in ns1
        seq = tokens(3000, 3)
        a("write", name="tp0", tokens=seq, seed=1)
        assert b("prefetch", name="tp1", tokens=seq)["hit"] == 0
        b("write", name="tp1", tokens=seq, seed=2)
        mine = a("prefetch", name="tp0", tokens=seq)
        theirs = b("prefetch", name="tp1", tokens=seq)
        assert mine["loaded"] == theirs["loaded"] == len(seq)
        assert mine["pages"] != theirs["pages"]  # each rank reads its own bytes
        a("open", name="tp", socket=server.socket)  # leave rank 0 of 1 for the tests after
        b("open", name="tp", socket=server.socket)
    no_errors(a, b)


def test_bad_input(workers: dict[str, Worker]) -> None:
    a = workers["A"]
    with running_server(num_blocks=16) as server:
        refused = a("open", name="bad", socket=server.socket,
                    geometry={"head_dim": 16})["refused"]
        assert "radixkv's pool layout (2 layers, 2 kv heads x 8, fp32, block_size 4)" in refused
        assert "SGLang's host KV pool (2 layers, 2 kv heads x 16, fp32, page_size 4)" in refused
        refused = a("open", name="bad", socket=server.socket, layout="layer_first")["refused"]
        assert "layout 'layer_first' is not supported" in refused
        a("open", name="ok", socket=server.socket)
        assert a("exists", name="ok", keys=["ab" * 31])["exists"] == 0  # 31 bytes: refused
        assert a("exists", name="ok", keys=["not hex"])["exists"] == 0
        errors = a("errors")["errors"]
        assert any("hex of 8..64 bytes (a multiple of 4), all of one size; got 31 bytes" in e
                   for e in errors), errors
        assert any("not hex" in e for e in errors), errors


def test_radixkv_down_then_back(workers: dict[str, Worker]) -> None:
    """No radixkv: misses, no exception out of SGLang's threads; once it is up, hits."""
    b = workers["B"]
    with tempfile.TemporaryDirectory(prefix="rkv-") as d:
        sock = os.path.join(d, "s.sock")
        b("open", name="down", socket=sock, extra={"retry_s": 0.2})
        seq = tokens(4000, 3)
        assert b("write", name="down", tokens=seq, seed=1)["stored"] == 0
        assert b("prefetch", name="down", tokens=seq)["hit"] == 0
        with running_server(num_blocks=16, socket_path=sock):
            time.sleep(0.3)
            assert stored_write(b, "down", seq, seed=1)["stored"] == len(seq)
            assert loaded_prefetch(b, "down", seq)["loaded"] == len(seq)
    no_errors(b)


def test_sglang_failure_injector(workers: dict[str, Worker]) -> None:
    """SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE=0.3 on B's backend: whatever fails, a load
    gives only pages A wrote, byte for byte, and nothing raises."""
    a, f = workers["A"], workers["B"]
    with running_server(num_blocks=128) as server:
        a("open", name="inj", socket=server.socket)
        f("open", name="inj", socket=server.socket,
          env={"SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE": "0.3"})
        for i in range(12):
            seq = tokens(20_000 + 100 * i, 4)
            wrote = a("write", name="inj", tokens=seq, seed=i)
            got = f("prefetch", name="inj", tokens=seq, rid=f"r{i}")
            assert got["loaded"] <= got["hit"] <= len(seq)
            assert got["pages"] == wrote["pages"][:got["loaded"] // PAGE]
            f("write", name="inj", tokens=tokens(50_000 + 100 * i, 4), seed=i)
        with Client(server.socket) as kv:
            assert kv.stats(check_integrity=True)["integrity"] == "ok"
    stats = f("stats", name="inj")
    assert stats["stats"]["link_failures"] == 0  # radixkv itself never failed
    assert sum(stats["prefetch_pgs"]) == stats["stats"]["get_pages"] - \
        stats["stats"]["get_failed_pages"]  # SGLang's storage metrics count the loads
    errors = [e for e in f("errors")["errors"] if "radixkv" in e]
    assert errors == []


def test_radixkv_killed_mid_prefetch(workers: dict[str, Worker]) -> None:
    """SIGKILL radixkv while B prefetches in a loop: every answer is a miss or A's bytes, and
    nothing raises; a radixkv restarted on the socket serves again (and its start reclaims the
    killed one's shared memory)."""
    a, b = workers["A"], workers["B"]
    with tempfile.TemporaryDirectory(prefix="rkv-") as d:
        sock = os.path.join(d, "s.sock")
        seq = tokens(30_000, 16)
        server = start_server(sock, "--model-config", tiny_config_path(d), "--block-size",
                              str(PAGE), "--num-blocks", "64")
        try:
            with Client(sock) as kv:
                shm = "/dev/shm/" + kv.pool_info().handle.name.lstrip("/")
            a("open", name="kill", socket=sock)
            b("open", name="kill", socket=sock, extra={"retry_s": 0.2})
            wrote = a("write", name="kill", tokens=seq, seed=5)
            results: list[dict[str, Any]] = []
            killed = threading.Event()

            def loop() -> None:
                after = 0
                for i in range(200):
                    results.append(b("prefetch", name="kill", tokens=seq, rid=f"k{i}"))
                    after += killed.is_set()
                    if after > 3:
                        return

            t = threading.Thread(target=loop)
            t.start()
            while not results:
                time.sleep(0.01)
            server.stop(signal.SIGKILL)
            killed.set()
            t.join(timeout=120)
            assert not t.is_alive()
        finally:
            server.stop(signal.SIGKILL)
        for got in results:
            assert got["loaded"] <= got["hit"]
            assert got["pages"] == wrote["pages"][:got["loaded"] // PAGE]
        assert results[0]["loaded"] == len(seq) and results[-1]["hit"] == 0
        with running_server(num_blocks=64, socket_path=sock):
            assert not os.path.exists(shm)  # the restart reclaimed the killed pool
            time.sleep(0.3)  # past B's retry_s
            assert b("prefetch", name="kill", tokens=seq)["hit"] == 0  # a new, empty pool
            wrote = stored_write(a, "kill", seq, seed=6)
            got = loaded_prefetch(b, "kill", seq)
            assert got["loaded"] == len(seq) and got["pages"] == wrote["pages"]
    no_errors(a, b)


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_host_slots_past_the_host_pool_are_refused(workers: dict[str, Worker],
                                                   layout: str) -> None:
    """An 8-page host pool (32 slots): a set whose second page's slots lie past it stores the
    first page only ([True, False]); a get into slots past it, or not page-aligned, loads the
    first page only and writes no host page but the first's."""
    a, b = workers["A"], workers["B"]
    name = f"range-{layout}"
    with running_server(num_blocks=16) as server:
        for w in (a, b):
            w("open", name=name, layout=layout, socket=server.socket,
              geometry={"host_pages": 8})
        keys = a("keys", name=name, tokens=tokens(7000, 2))["keys"]
        wrote = a("set", name=name, keys=keys, slots=[28, 29, 30, 31, 32, 33, 34, 35], seed=4)
        assert wrote["done"] == [True, False]
        assert a("stats", name=name)["stats"]["bad_slot_pages"] == 1  # its Insert answered
        (n,) = leases_back_to(server.socket, 0)["namespaces"]
        assert n["cached_blocks"] == 1
        for slots in ([28, 29, 30, 31, 32, 33, 34, 35], [0, 1, 2, 3, 6, 7, 8, 9]):
            got = b("get", name=name, keys=keys, slots=slots)
            assert got["done"] == [True, False]
            first = slots[0] // PAGE
            assert got["host_after"][first] == wrote["pages"][0]  # A's page, into B's slots
            assert [d for i, d in enumerate(got["host_after"]) if i != first] == \
                [d for i, d in enumerate(got["host_before"]) if i != first]
        errors = a("errors")["errors"] + b("errors")["errors"]
        assert len(errors) == 2 and all("not whole pages" in e for e in errors), errors
        leases_back_to(server.socket, 0)
