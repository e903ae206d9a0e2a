"""When radixkv's SGLang backend answers a prefetch (batch_get_v1) without waiting for the
Release of the lease it copied under, and when it must wait: SGLang's real HiCacheController in
worker processes (tests/integrations/sglang/_sglang_worker.py) against a real radixkv server.

The pins a lease holds end only by its Release, its TTL or radixkv's death, so a copy out of a
host pool that ended within (Match sent + TTL - margin), radixkv alive after it, read pinned
bytes: the get answers at once. A copy past that waits for the Release, whose answer decides."""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from typing import Any

import pytest
from _server import running_server, tiny_config_path
from _sglang_workers import Worker, leases_back_to, no_errors, tokens

from radixkv.server.launch import start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_get_answers_before_radixkv_processes_its_release(
        workers: dict[str, Worker]) -> None:
    """(`lookup: match`: the exists pins.) radixkv is stopped (SIGSTOP) between batch_exists
    and batch_get_v1: the get copies under the exists' lease and answers True with A's bytes at
    once, its Release still on its way; once radixkv runs again that Release ends the lease
    (not its TTL), exactly once."""
    a, b = workers["A"], workers["B"]
    with tempfile.TemporaryDirectory(prefix="rkv-") as d:
        sock = os.path.join(d, "s.sock")
        server = start_server(sock, "--model-config", tiny_config_path(d), "--block-size",
                              "4", "--num-blocks", "32")
        try:
            a("open", name="nowait", socket=sock)
            b("open", name="nowait", socket=sock, extra={"lookup": "match"})
            seq = tokens(40_000, 4)
            wrote = a("write", name="nowait", tokens=seq, seed=8)
            keys = a("keys", name="nowait", tokens=seq)["keys"]
            deadline = time.monotonic() + 10  # A's write answers before its Insert lands
            while b("exists", name="nowait", keys=keys)["exists"] < 4:
                assert time.monotonic() < deadline, "A's write never became visible to B"
                time.sleep(0.05)
            server.proc.send_signal(signal.SIGSTOP)
            try:
                got = b("get", name="nowait", keys=keys)
                assert got["done"] == [True] * 4 and got["pages"] == wrote["pages"]
                assert got["seconds"] < 2.0  # the Release would wait for radixkv (5 s timeout)
            finally:
                server.proc.send_signal(signal.SIGCONT)
            s = leases_back_to(sock, 0)
            assert s["expired_leases"] == 0 and s["integrity"] == "ok"
            stats = b("stats", name="nowait")["stats"]
            assert stats["get_releases_nowait"] == 1 and stats["get_releases_waited"] == 0
            assert stats["release_failures"] == 0 and stats["get_leases_lost"] == 0
        finally:
            assert server.stop() == 0
    no_errors(a, b)


def test_a_copy_past_the_lease_ttl_loads_nothing(workers: dict[str, Worker]) -> None:
    """B's copy outlives its lease (1 s TTL): meanwhile the lease expires and A's next write
    evicts those blocks and reuses them for other bytes. The copy read them, but the get
    answers False for every page (its Release, waited for, finds the lease expired) and loads
    nothing; the lease ended once (by its TTL); the next prefetch loads A's new bytes."""
    a, b = workers["A"], workers["B"]
    # a pool of 3 blocks; a 2 s default TTL: the sweeper runs every 0.5 s
    with running_server(num_blocks=3, lease_ttl=2.0) as server:
        a("open", name="late", socket=server.socket)
        b("open", name="late", socket=server.socket,
          extra={"exists_hold_s": 1.0, "lookup": "match"})
        one, two = tokens(41_000, 3), tokens(42_000, 3)
        a("write", name="late", tokens=one, seed=1)
        keys = a("keys", name="late", tokens=one)["keys"]
        assert b("exists", name="late", keys=keys)["exists"] == 3
        b("slow_copy", seconds=4.0)
        answer: dict[str, Any] = {}
        getter = threading.Thread(target=lambda: answer.update(b("get", name="late",
                                                                  keys=keys)))
        getter.start()
        try:
            time.sleep(1.6)  # the lease expired at 1 s and was swept by 1.5 s
            deadline = time.monotonic() + 10  # (later on a loaded machine)
            while (wrote := a("write", name="late", tokens=two, seed=2))["stored"] == 0:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            assert wrote["stored"] == len(two)  # into the blocks B's copy reads
            getter.join(timeout=30)
        finally:
            b("slow_copy", seconds=0)
        assert answer["done"] == [False] * 3 and answer["pages"] == []
        stats = b("stats", name="late")["stats"]
        assert stats["get_releases_waited"] == 1 and stats["get_leases_lost"] == 1
        assert stats["get_releases_nowait"] == 0
        s = leases_back_to(server.socket, 0)
        assert s["expired_leases"] == 1 and s["integrity"] == "ok"
        got = b("prefetch", name="late", tokens=two)
        assert got["loaded"] == len(two) and got["pages"] == wrote["pages"]
    no_errors(a, b)


def test_a_copy_past_the_margin_waits_for_its_release(workers: dict[str, Worker]) -> None:
    """(`lookup: match`: the get copies under the exists' lease.) A copy that ends after
    (Match sent + TTL - margin) but within the TTL: the get waits for its Release, which finds
    the lease valid: the pages load."""
    a, b = workers["A"], workers["B"]
    with running_server(num_blocks=16) as server:
        a("open", name="margin", socket=server.socket)
        # a 5 s lease and a 4.7 s margin: a copy of 0.5 s ends past the unwaited limit
        b("open", name="margin", socket=server.socket,
          extra={"release_margin_s": 4.7, "lookup": "match"})
        seq = tokens(43_000, 3)
        wrote = a("write", name="margin", tokens=seq, seed=3)
        keys = a("keys", name="margin", tokens=seq)["keys"]
        assert b("exists", name="margin", keys=keys)["exists"] == 3
        b("slow_copy", seconds=0.5)
        try:
            got = b("get", name="margin", keys=keys)
        finally:
            b("slow_copy", seconds=0)
        assert got["done"] == [True] * 3 and got["pages"] == wrote["pages"]
        stats = b("stats", name="margin")["stats"]
        assert stats["get_releases_waited"] == 1 and stats["get_releases_nowait"] == 0
        s = leases_back_to(server.socket, 0)
        assert s["expired_leases"] == 0
    no_errors(a, b)
