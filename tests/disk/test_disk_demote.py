"""Demotion copies the evicted blocks' bytes out of the pool off the service lock (in process:
the real pool and tier, the copy out of the pool held at a gate): a Match answers meanwhile and
finds those blocks not on disk yet (a miss), a block another call still copies out is handed
to nobody before the copy is made, and a block that leaves the disk index before its copy is
made is never written."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from _disk import BS, hits, kv_of, tokens_of

from kvpool import create_pool
from kvpool.layout import KVLayout
from radixkv.disk.tier import DiskTier
from radixkv.service import KVService, ServiceConfig

POOL = 8  # 4-token blocks of 128 bytes, an 8-block pool






class Services:
    """Opens the service on one disk directory (again after `stop`: a restart)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.running: list[tuple[KVService, Any]] = []

    def open(self) -> tuple[KVService, Any, DiskTier]:
        pool = create_pool(KVLayout(1, 1, 4, "fp32", BS), num_blocks=POOL)
        tier = DiskTier(pool, self.directory, 16)
        svc = KVService(pool, ServiceConfig(lease_ttl_s=60, policy="lru"), tier=tier)
        self.running.append((svc, pool))
        return svc, pool, tier

    def stop(self) -> None:
        while self.running:
            svc, pool = self.running.pop()
            svc.close_tier(write_down=False)
            pool.close()


@pytest.fixture
def services(tmp_path: Any) -> Iterator[Services]:
    os.mkdir(tmp_path / "d", 0o700)
    s = Services(str(tmp_path / "d"))
    yield s
    s.stop()


def store(svc: KVService, pool: Any, ns: str, prompt: tuple[int, ...],
          release: bool = True) -> int:
    """Cache `prompt` in `ns`, each block holding kv_of its prefix; returns the lease."""
    r = svc.allocate("e", None, ns, len(prompt))
    for j, b in enumerate(r.block_ids):
        pool.block_bytes(b)[:] = kv_of(prompt[:j + 1])
    svc.insert("e", r.lease_id, ns, tokens_of(prompt), r.block_ids)
    if release:
        svc.release("e", [r.lease_id])
    return r.lease_id




class CopyGate:
    """Holds the first read of a pool block's bytes that thread `name` makes (the disk tier's
    copy out of a demoted block) until `open`."""

    def __init__(self, pool: Any, name: str) -> None:
        self.pool, self.name, self.real = pool, name, pool.block_bytes
        self.held, self.gate, self.armed = threading.Event(), threading.Event(), True
        pool.block_bytes = self._block_bytes

    def _block_bytes(self, b: int) -> Any:
        if self.armed and threading.current_thread().name == self.name:
            self.armed = False
            self.held.set()
            self.gate.wait(30)
        return self.real(b)

    def open(self) -> None:
        self.gate.set()
        self.pool.block_bytes = self.real


def in_thread(name: str, fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()), name=name, daemon=True)
    t.start()
    return t, out


def test_a_match_answers_while_an_allocate_copies_its_demoted_blocks_out(services):
    """An Allocate that evicts a 4-block prompt is held in its copy of the first: a Match of
    another namespace answers meanwhile (the copy is off the service lock), a Match of the
    demoted prompt misses it (not on disk until copied) and serves nothing wrong, the
    integrity check holds; once the copy is made the prompt comes back from disk exactly."""
    svc, pool, tier = services.open()
    a = (1, 2, 3, 4)
    store(svc, pool, "a", a)
    hot = store(svc, pool, "hot", (7, 8), release=False)  # pinned: never evicted
    gate = CopyGate(pool, "demoter")
    try:
        demoter, got = in_thread("demoter", lambda: svc.allocate("e", None, "x", 6))
        assert gate.held.wait(10)
        matcher, _ = in_thread("matcher", lambda: hits(svc, pool, "hot", (7, 8)))
        matcher.join(10)
        assert not matcher.is_alive(), "a Match waited for the demoted blocks' copy"
        assert hits(svc, pool, "a", a) == 0  # not on disk yet: a miss
        svc.check_integrity()
        assert svc.stats().disk.demoted_blocks == 4
    finally:
        gate.open()
    demoter.join(10)
    svc.release("e", [got[0].lease_id])
    tier.flush()
    assert svc.stats().disk.blocks == 4
    assert hits(svc, pool, "a", a) == 4  # promoted, byte for byte
    svc.release("e", [hot])
    svc.check_integrity()


def test_a_block_another_call_still_copies_out_is_handed_out_only_once_copied(services):
    """Lease L holds every free block; an Allocate on L evicts prompt A into L, and is held
    in the copy of A's first block. Meanwhile another client releases L (A's blocks back on
    the free list) and allocates the whole pool, writing over every block: its Allocate must
    wait for the copy, or A's blocks on disk would hold its bytes (wrong KV, checksum and
    all). A comes back from disk exactly."""
    svc, pool, tier = services.open()
    a = (1, 2, 3, 4)
    store(svc, pool, "a", a)
    lease = svc.allocate("e", None, "x", POOL - len(a)).lease_id  # the pool is full
    gate = CopyGate(pool, "demoter")

    def overwrite() -> None:
        svc.release("e", [lease])
        r = svc.allocate("f", None, "y", POOL)
        for b in r.block_ids:
            pool.block_bytes(b)[:] = 0xEE
        svc.release("f", [r.lease_id])

    try:
        demoter, _ = in_thread("demoter", lambda: svc.allocate("e", lease, "x", len(a)))
        assert gate.held.wait(10)
        other, _ = in_thread("other", overwrite)
        other.join(0.5)  # (with the guard it waits for the copy: it cannot finish yet)
    finally:
        gate.open()
    demoter.join(10)
    other.join(10)
    assert not other.is_alive()
    tier.flush()
    assert hits(svc, pool, "a", a) == 4
    svc.check_integrity()


def test_a_block_cleared_before_its_copy_is_made_is_never_written(services):
    """A Clear of the namespace while its demoted blocks' copy is held: they are not written
    after (their slots' tombstones stand), and a restart brings none of them back."""
    svc, pool, tier = services.open()
    a = (1, 2, 3, 4)
    store(svc, pool, "a", a)
    gate = CopyGate(pool, "demoter")
    try:
        demoter, got = in_thread("demoter", lambda: svc.allocate("e", None, "x", POOL))
        assert gate.held.wait(10)
        assert svc.clear("a") == 0  # on disk only
    finally:
        gate.open()
    demoter.join(10)
    svc.release("e", [got[0].lease_id])
    tier.flush()
    assert svc.stats().disk.blocks == 0
    svc.check_integrity()
    services.stop()
    svc, pool, tier = services.open()
    assert svc.stats().disk.loaded_blocks == 0
    assert hits(svc, pool, "a", a) == 0
