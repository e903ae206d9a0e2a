"""When radixkv's SGLang backend answers a backup (batch_set_v1): once its copy into radixkv's
pool ended, before radixkv processed the Insert that makes the pages matchable (sent after the
answer from a background thread). SGLang's real HiCacheController in worker processes
(tests/integrations/sglang/_sglang_worker.py) against a real radixkv server.

A True tells SGLang only that it may go on and free its host slots (the copy out of them
ended); whether a page is in radixkv is asked later (batch_exists), and radixkv may evict any
page at any moment. An Insert that fails after the answer is thus an eviction right after it:
nothing is matchable, the failure is counted, no exception reaches SGLang's threads."""

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


def _server(d: str, *flags: str) -> Any:
    return start_server(os.path.join(d, "s.sock"), "--model-config", tiny_config_path(d),
                        "--block-size", "4", *flags)


def _write_stopped_after_match(a: Worker, server: Any, seq: list[int], seed: int,
                               name: str) -> dict[str, Any]:
    """A's write of `seq` with radixkv stopped (SIGSTOP) once the write's Match was answered
    (its lease is live), during the copy; the write's answer, radixkv still stopped."""
    answer: dict[str, Any] = {}
    a("slow_copy", seconds=1.0, to_pool=True)
    writer = threading.Thread(target=lambda: answer.update(a("write", name=name, tokens=seq,
                                                             seed=seed, settle=False)))
    writer.start()
    try:
        with Client(server.socket) as kv:
            wait_for(lambda: kv.stats()["live_leases"] >= 1, timeout=30, what="the Match")
        server.proc.send_signal(signal.SIGSTOP)
        writer.join(timeout=30)
    finally:
        if not writer.is_alive():
            a("slow_copy", seconds=0, to_pool=True)
    assert not writer.is_alive()
    return answer


def test_a_backup_answers_before_radixkv_processes_its_insert(
        workers: dict[str, Worker]) -> None:
    """radixkv is stopped between the backup's Match and its Insert: A's write answers True for
    every page all the same; once radixkv runs again the Insert lands and B loads A's bytes."""
    a, b = workers["A"], workers["B"]
    with tempfile.TemporaryDirectory(prefix="rkv-") as d:
        server = _server(d, "--num-blocks", "32")
        try:
            a("open", name="early", socket=server.socket)
            b("open", name="early", socket=server.socket)
            seq = tokens(50_000, 4)
            try:
                wrote = _write_stopped_after_match(a, server, seq, 5, "early")
                assert wrote["stored"] == len(seq)  # answered while radixkv is stopped
            finally:
                server.proc.send_signal(signal.SIGCONT)
            stats = a("stats", name="early")["stats"]  # (after the queued Insert)
            assert stats["set_stored_pages"] == 4 and stats["set_insert_failed_pages"] == 0
            assert stats["insert_calls"] == 1
            got = b("prefetch", name="early", tokens=seq)
            assert got["loaded"] == len(seq) and got["pages"] == wrote["pages"]
            s = leases_back_to(server.socket, 0)
            assert s["expired_leases"] == 0 and s["integrity"] == "ok"
        finally:
            assert server.stop() == 0
    no_errors(a, b)


def test_an_insert_after_its_lease_expired_stores_nothing(workers: dict[str, Worker]) -> None:
    """A's copy into radixkv's pool outlives the lease of its Match (1 s TTL): the write has
    answered True, but radixkv refuses the Insert: nothing is matchable, the failure is counted
    and logged as a warning, and no exception reaches SGLang's threads."""
    a, b = workers["A"], workers["B"]
    with tempfile.TemporaryDirectory(prefix="rkv-") as d:
        server = _server(d, "--num-blocks", "32", "--lease-ttl", "1")
        try:
            a("open", name="expired", socket=server.socket)
            b("open", name="expired", socket=server.socket)
            seq = tokens(51_000, 3)
            a("slow_copy", seconds=2.5, to_pool=True)
            try:
                wrote = a("write", name="expired", tokens=seq, seed=6)
            finally:
                a("slow_copy", seconds=0, to_pool=True)
            assert wrote["stored"] == len(seq)
            stats = a("stats", name="expired")["stats"]
            assert stats["set_insert_failed_pages"] == 3 and stats["set_stored_pages"] == 0
            got = b("prefetch", name="expired", tokens=seq)
            assert got["loaded"] == 0
            s = leases_back_to(server.socket, 0)
            assert s["expired_leases"] == 1 and s["integrity"] == "ok"
            # the next backup of those pages stores them
            wrote = a("write", name="expired", tokens=seq, seed=6)
            got = loaded_prefetch(b, "expired", seq)
            assert got["loaded"] == len(seq) and got["pages"] == wrote["pages"]
        finally:
            assert server.stop() == 0
    no_errors(a, b)


def test_an_insert_after_radixkv_died_stores_nothing(workers: dict[str, Worker]) -> None:
    """radixkv is stopped after the backup's Match, the write answers, then radixkv is killed:
    the queued Insert fails (counted), no exception reaches SGLang's threads; a radixkv
    restarted on the socket holds nothing of it, and A's next backup there stores the pages."""
    a, b = workers["A"], workers["B"]
    with tempfile.TemporaryDirectory(prefix="rkv-") as d:
        server = _server(d, "--num-blocks", "32")
        try:
            a("open", name="died", socket=server.socket, extra={"timeout": 1.0, "retry_s": 0.2})
            b("open", name="died", socket=server.socket, extra={"retry_s": 0.2})
            seq = tokens(52_000, 3)
            wrote = _write_stopped_after_match(a, server, seq, 7, "died")
            assert wrote["stored"] == len(seq)
        finally:
            server.stop(signal.SIGKILL)  # (ends a stopped process too)
        stats = a("stats", name="died")["stats"]
        assert stats["set_insert_failed_pages"] == 3 and stats["set_stored_pages"] == 0
        with running_server(num_blocks=32, socket_path=server.socket):
            time.sleep(0.3)  # past retry_s
            assert b("prefetch", name="died", tokens=seq)["hit"] == 0  # a new, empty pool
            again = stored_write(a, "died", seq, seed=7)
            got = loaded_prefetch(b, "died", seq)
            assert got["loaded"] == len(seq) and got["pages"] == again["pages"] == wrote["pages"]
    no_errors(a, b)


def test_reads_after_a_write_see_it(workers: dict[str, Worker]) -> None:
    """Each Insert is slowed (2 s): right after A's write, A's prefetch finds every page (it
    waits for A's queued Insert), while B, another backend, does not yet; a backup longer than
    one SGLang batch (128 pages) extends the path of its first batch, whose Insert was still
    queued when the second batch matched."""
    a, b = workers["A"], workers["B"]
    with tempfile.TemporaryDirectory(prefix="rkv-") as d:
        server = _server(d, "--num-blocks", "400")
        try:
            a("open", name="ryw", socket=server.socket, geometry={"host_pages": 300})
            b("open", name="ryw", socket=server.socket, geometry={"host_pages": 300})
            seq = tokens(53_000, 3)
            a("slow_insert", seconds=2.0)
            try:
                start = time.monotonic()
                wrote = a("write", name="ryw", tokens=seq, seed=8, settle=False)
                assert wrote["stored"] == len(seq) and time.monotonic() - start < 2.0
                assert b("prefetch", name="ryw", tokens=seq)["loaded"] == 0
                got = a("prefetch", name="ryw", tokens=seq)
                assert got["loaded"] == len(seq) and got["pages"] == wrote["pages"]
                long = tokens(54_000, 130)
                wrote = a("write", name="ryw", tokens=long, seed=9, settle=False)
                assert wrote["stored"] == len(long)
            finally:
                a("slow_insert", seconds=0)
            stats = a("stats", name="ryw")["stats"]  # (after A's queued Inserts)
            assert stats["set_insert_failed_pages"] == 0 and stats["set_stored_pages"] == 133
            got = b("prefetch", name="ryw", tokens=long)
            assert got["loaded"] == len(long) and got["pages"] == wrote["pages"]
        finally:
            assert server.stop() == 0
    no_errors(a, b)
