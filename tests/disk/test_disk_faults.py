"""The disk tier's trust and faults: a directory or slot file another user could write is
refused, a second server on one directory exits 2 naming the first (real servers); a Clear
that answered stays cleared across a crash while the writer has a backlog, and a write error
is retried and reported, the tier and its warm restart working after it (in process, the slot
file's writes gated or failed by a patched os.pwritev / os.pwrite)."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from _disk import BS, hits, kv_of, put, read_in_other_process, tokens_of
from _disk import prompt as p
from _server import REPO, tiny_config_path

from kvpool import create_pool
from kvpool.layout import KVLayout
from radixkv.client import Client
from radixkv.disk import writer as writer_module
from radixkv.disk.claim import LOCK_NAME
from radixkv.disk.slots import FILE_NAME
from radixkv.disk.tier import DiskTier
from radixkv.protocol.errors import Unavailable
from radixkv.server.launch import start_server
from radixkv.server.metrics import ServiceCollector
from radixkv.service import KVService, ServiceConfig

POOL = 6


@pytest.fixture
def workdir(tmp_path: Any) -> str:
    os.mkdir(tmp_path / "disk", 0o700)
    return str(tmp_path)


def _serve_fails(d: str, disk_dir: str, sock: str = "s.sock") -> str:
    args = [sys.executable, "-m", "radixkv", "serve", "--socket", os.path.join(d, sock),
            "--model-config", tiny_config_path(d), "--block-size", str(BS), "--num-blocks", "8",
            "--disk-dir", disk_dir, "--disk-capacity-blocks", "8"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert out.stderr.startswith(f"radixkv serve: --disk-dir {disk_dir}"), out.stderr
    return out.stderr


def test_a_disk_dir_or_slot_file_others_could_write_is_refused(workdir):
    disk = os.path.join(workdir, "disk")
    os.chmod(disk, 0o777)
    assert "must not be writable by group or others" in _serve_fails(workdir, disk)
    os.chmod(disk, 0o700)
    slots = os.path.join(disk, FILE_NAME)
    open(slots, "w").close()
    os.chmod(slots, 0o666)
    assert "not writable by group or others" in _serve_fails(workdir, disk)
    if os.geteuid() == 0:  # another user's file (root can give one away)
        os.chmod(slots, 0o600)
        os.chown(slots, 65534, 65534)
        assert "is owned by uid 65534" in _serve_fails(workdir, disk)
    os.unlink(slots)
    os.symlink(os.path.join(workdir, "elsewhere"), slots)
    assert "is a symbolic link" in _serve_fails(workdir, disk)
    assert not os.path.exists(os.path.join(workdir, "elsewhere"))
    os.unlink(slots)
    os.unlink(os.path.join(disk, LOCK_NAME))  # (left by the starts above, as after any stop)
    os.symlink(os.path.join(workdir, "elsewhere"), os.path.join(disk, LOCK_NAME))
    assert "is a symbolic link" in _serve_fails(workdir, disk)


def test_a_second_server_on_one_disk_dir_exits_2_naming_the_first(workdir):
    disk = os.path.join(workdir, "disk")
    first = start_server(os.path.join(workdir, "a.sock"), "--model-config",
                         tiny_config_path(workdir), "--block-size", str(BS), "--num-blocks", "4",
                         "--disk-dir", disk, "--disk-capacity-blocks", "8")
    try:
        prompts = [p(i) for i in range(4)]  # 8 blocks through a 4-block pool: 4 on disk
        with Client(first.socket) as kv:
            for t in prompts:
                put(kv, "ns", t)
        err = _serve_fails(workdir, disk, sock="b.sock")
        assert f"is in use: another radixkv server (pid {first.proc.pid}) holds it" in err
        assert read_in_other_process(first.socket, "ns", prompts[:2]) == [2 * BS] * 2  # disk
        with Client(first.socket) as kv:
            s = kv.stats(check_integrity=True)
            assert s["integrity"] == "ok" and s["disk"]["verify_failures"] == 0
    finally:
        assert first.stop() == 0, first.output()
    again = start_server(os.path.join(workdir, "c.sock"), "--model-config",  # the lock let go
                         tiny_config_path(workdir), "--block-size", str(BS), "--num-blocks", "4",
                         "--disk-dir", disk, "--disk-capacity-blocks", "8")
    try:
        with Client(again.socket) as kv:
            assert kv.stats()["disk"]["loaded_blocks"] == 8
    finally:
        assert again.stop() == 0, again.output()


# ---- in process: the slot file's writes gated or failed ----------------------------------------





def open_service(directory: str) -> tuple[KVService, Any, DiskTier]:
    pool = create_pool(KVLayout(1, 1, 4, "fp32", BS), num_blocks=POOL)
    tier = DiskTier(pool, directory, 16)
    return KVService(pool, ServiceConfig(lease_ttl_s=60, policy="lru"), tier=tier), pool, tier


def store_and_demote(svc: KVService, pool: Any, ns: str, prompt: tuple[int, ...]) -> None:
    """Cache `prompt` in `ns` (each block holding kv_of its prefix), then evict it to disk."""
    r = svc.allocate("e", None, ns, len(prompt))
    for j, b in enumerate(r.block_ids):
        pool.block_bytes(b)[:] = kv_of(prompt[:j + 1])
    svc.insert("e", r.lease_id, ns, tokens_of(prompt), r.block_ids)
    svc.release("e", [r.lease_id])
    hog = svc.allocate("e", None, "hog", POOL)  # every pool block: the prompt is demoted
    svc.release("e", [hog.lease_id])




def until(what: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_clear_that_answered_survives_a_crash_while_the_writer_has_a_backlog(
        tmp_path, monkeypatch):
    os.mkdir(tmp_path / "d", 0o700)
    os.mkdir(tmp_path / "crash", 0o700)
    svc, pool, tier = open_service(str(tmp_path / "d"))
    try:
        store_and_demote(svc, pool, "x", (1, 2, 0))
        tier.flush()  # x's 3 blocks on disk, fsynced
        gate, syncs, fsync = threading.Event(), [], os.fsync
        for name in ("pwrite", "pwritev"):  # a slow disk: each write waits at the gate
            real = getattr(os, name)
            monkeypatch.setattr(os, name, lambda *a, real=real: gate.wait() and real(*a))
        monkeypatch.setattr(os, "fsync", lambda fd: syncs.append(gate.is_set()) or fsync(fd))
        store_and_demote(svc, pool, "y", (3, 4, 5))  # a backlog: y's writes wait at the gate
        threading.Timer(0.3, gate.set).start()
        svc.clear("x")
        shutil.copyfile(tmp_path / "d" / FILE_NAME, tmp_path / "crash" / FILE_NAME)  # SIGKILL
        synced = list(syncs)
        gate.set()
        crashed = DiskTier(pool, str(tmp_path / "crash"), 16)
        try:
            assert not crashed.index.has_namespace("x")  # the cleared blocks stay cleared
            assert crashed.stats().loaded_blocks == 3  # y's
        finally:
            crashed.close(write_down=False)
        assert synced == [True]  # Clear fsynced once, after the gated writes went through
        assert hits(svc, pool, "x", (1, 2, 0)) == 0 and hits(svc, pool, "y", (3, 4, 5)) == 3
    finally:
        svc.close_tier(write_down=False)
        pool.close()


def disk_up(svc: KVService) -> float:
    family = next(f for f in ServiceCollector(svc).collect() if f.name == "radixkv_disk_up")
    return float(family.samples[0].value)


def test_a_write_error_is_retried_and_reported_and_warm_restart_still_works(
        tmp_path, monkeypatch):
    fail: list[int] = [1]  # the next writes that fail (-1: every one until set to 0)
    queued = threading.Event()  # a failure waits until the demotions are queued

    def flaky(real: Callable[..., int]) -> Callable[..., int]:
        def write(fd: int, data: Any, offset: int) -> int:
            if fail[0]:
                queued.wait()
                fail[0] -= fail[0] > 0
                raise OSError(errno.EIO, "Input/output error (injected)")
            return real(fd, data, offset)
        return write

    a, b, c = (1, 2, 0), (3, 4, 5), (6, 7, 8)
    svc, pool, tier = open_service(str(tmp_path))
    monkeypatch.setattr(os, "pwritev", flaky(os.pwritev))  # slots
    monkeypatch.setattr(os, "pwrite", flaky(os.pwrite))  # tombstones
    monkeypatch.setattr(writer_module, "SYNC_FAILING_S", 0.2)
    try:
        store_and_demote(svc, pool, "ns", a)  # its first write fails, the retry succeeds
        queued.set()
        until(lambda: svc.stats().disk.pending_writes == 0)
        store_and_demote(svc, pool, "ns", b)  # written: one error did not end the tier
        until(lambda: svc.stats().disk.pending_writes == 0)
        d = svc.stats().disk
        assert (d.blocks, d.evicted_blocks) == (6, 0)  # nothing dropped
        assert (d.state, d.write_errors) == ("ok", 1)
        assert d.last_error == "[Errno 5] Input/output error (injected)"
        fail[0] = -1  # the disk fails until further notice
        queued.clear()
        store_and_demote(svc, pool, "c", c)
        queued.set()
        until(lambda: svc.stats().disk.state == "failing")
        assert disk_up(svc) == 0 and svc.stats().disk.pending_writes == 3
        with pytest.raises(Unavailable, match="cannot write .*Input/output error"):
            svc.clear("c")  # cleared, but not durably: said so
        fail[0] = 0
        until(lambda: svc.stats().disk.state == "ok" and svc.stats().disk.pending_writes == 0)
        assert disk_up(svc) == 1 and svc.stats().disk.write_errors > 2
        assert hits(svc, pool, "ns", a) == 3 and hits(svc, pool, "ns", b) == 3  # from disk
        svc.check_integrity()
    finally:
        svc.close_tier(write_down=True)  # SIGTERM's write-down
        pool.close()
    svc, pool, tier = open_service(str(tmp_path))  # warm restart
    try:
        assert svc.stats().disk.loaded_blocks == 6
        assert hits(svc, pool, "ns", a) == 3 and hits(svc, pool, "ns", b) == 3
        assert hits(svc, pool, "c", c) == 0
    finally:
        svc.close_tier(write_down=False)
        pool.close()
