"""Promotion from the disk tier: a block comes up into a pool block of its slot's format (a
quantized pool's sink blocks carry their first tokens after the quantized part, so a regular
block's bytes there would read another prompt's sink tokens), the integrity check catches a
format mismatch, and a Clear racing a promotion answers FailedPrecondition (nothing it cleared
comes back)."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from _server import tiny_config_path

from kvpool import create_pool
from kvpool.layout import KVLayout
from radixkv.client import Client
from radixkv.disk.tier import DiskTier
from radixkv.protocol.errors import FailedPrecondition, IntegrityError
from radixkv.server.launch import start_server
from radixkv.service import KVService, ServiceConfig

L, H, D, BS = 2, 2, 8, 4  # tests/_server.py's tiny model


@pytest.fixture
def workdir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="rkv-")
    os.mkdir(os.path.join(d, "disk"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def kv_of(values: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [layers, len(values) x BS, heads, dim]: block j all values[j]."""
    t = torch.tensor(values, dtype=torch.float32).repeat_interleave(BS)
    k = t.view(1, -1, 1, 1).expand(L, -1, H, D).contiguous()
    return k, k + 0.5


def test_a_promotion_lands_only_in_blocks_of_its_slots_format(workdir):
    """int8 with 2 sink tokens, 4 regular + 4 sink blocks: prompt A (positions 0-3: one sink
    block, three regular) is demoted; the pool's blocks are all written with 99 (sink tokens
    included) and freed; with every regular block leased, A's Match must not promote its
    regular blocks into sink blocks (their first 2 tokens would read 99); once regular blocks
    are free, A comes back exactly as written."""
    server = start_server(os.path.join(workdir, "s.sock"), "--model-config",
                          tiny_config_path(workdir), "--block-size", str(BS), "--num-blocks", "8",
                          "--kv-dtype", "int8", "--kv-sink-tokens", "2",
                          "--kv-sink-fraction", "0.5", "--disk-dir",
                          os.path.join(workdir, "disk"), "--disk-capacity-blocks", "16")
    try:
        with Client(server.socket) as kv:
            a = list(range(100, 100 + 4 * BS))
            m = kv.match("ns", a)
            ids = kv.allocate(4, lease_id=m.lease_id, starts_sequence=True).block_ids
            pool = kv.pool()
            pool.write(ids, *kv_of([1, 2, 3, 4]))
            want = pool.read(ids)
            kv.insert("ns", a, ids, m.lease_id, release=True)
            every = kv.allocate(8, namespace="other")  # evicts A: demoted
            pool.write(every.block_ids, *kv_of([99] * 8))
            kv.release(every.lease_id)
            held = kv.allocate(4, namespace="other")  # the regular blocks: only sinks free
            m = kv.match("ns", a)
            if m.block_ids:
                got = pool.read(m.block_ids)
                n = len(m.block_ids) * BS
                assert torch.equal(got[0], want[0][:, :n]) and torch.equal(got[1], want[1][:, :n])
            kv.release(m.lease_id)
            assert kv.stats(check_integrity=True)["integrity"] == "ok"
            kv.release(held.lease_id)
            m = kv.match("ns", a)
            assert m.num_tokens == 4 * BS
            got = pool.read(m.block_ids)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            kv.release(m.lease_id)
            s = kv.stats(check_integrity=True)
            assert s["integrity"] == "ok" and s["disk"]["verify_failures"] == 0
    finally:
        assert server.stop() == 0, server.output()


# ---- in process: the real pool and tier, a Match stopped while its blocks are read ----------

def _service(d: str, layout: KVLayout, num_blocks: int, gated: bool = False,
             **pool_kw: Any) -> tuple[Any, DiskTier, KVService]:
    pool = create_pool(layout, num_blocks=num_blocks, **pool_kw)
    tier = (GatedTier if gated else DiskTier)(pool, d, 16)
    return pool, tier, KVService(pool, ServiceConfig(lease_ttl_s=60, policy="lru"), tier=tier)


def _close(pool: Any, svc: KVService, write_down: bool = False) -> None:
    svc.close_tier(write_down=write_down)
    pool.close()


def _tokens(first: int, blocks: int) -> bytes:
    return np.arange(first, first + blocks * BS, dtype="<u4").tobytes()


def _store(svc: KVService, pool: Any, ns: str, tokens: bytes, value: int) -> None:
    blocks = len(tokens) // (4 * BS)
    m = svc.match("e", ns, tokens)
    ids = svc.allocate("e", m.lease_id, ns, blocks, starts_sequence=True).block_ids
    for b in ids:
        pool.block_bytes(b)[:] = value
    svc.insert("e", m.lease_id, ns, tokens, ids)
    svc.release("e", [m.lease_id])


def test_the_integrity_check_catches_a_block_of_the_other_format(workdir):
    """A pool that hands out sink blocks for a promotion's regular blocks (as its fallback
    does for an engine's Allocate when regular ones run out): while the Match reads, a
    reserved block's format is not its slot's, and check_integrity says so; the block is not
    read into (a payload that does not fill the block is not its format): a miss."""
    lay = KVLayout(L, H, D, "int8", BS, model_dtype="fp32", sink_tokens=2)
    pool, tier, svc = _service(os.path.join(workdir, "disk"), lay, 8, gated=True,
                               sink_fraction=0.5)
    try:
        a = _tokens(100, 2)
        _store(svc, pool, "ns", a, 7)
        every = svc.allocate("e", None, "other", 8)  # A demoted
        svc.release("e", [every.lease_id])
        svc.check_integrity()
        real = pool.alloc
        pool.alloc = lambda n, sinks=0, exact=False: real(n, n)  # every block a sink block

        def check() -> None:
            with pytest.raises(IntegrityError, match="is a sink block holding a regular-format"):
                svc.check_integrity()

        try:
            hit = _while_promoting(tier, svc, "ns", a, check)
        finally:
            pool.alloc = real
        assert hit == BS  # the first block only: the second was not read
        svc.check_integrity()
    finally:
        _close(pool, svc)


class GatedTier(DiskTier):
    """The disk tier, its promotions' reads held at a gate while the test calls Clear."""

    gate: threading.Event | None = None
    reading = threading.Event()

    def read(self, plans: Any) -> None:
        if self.gate is not None:
            self.reading.set()
            self.gate.wait(30)
        super().read(plans)


def _while_promoting(tier: GatedTier, svc: KVService, ns: str, tokens: bytes,
                     during: Callable[[], Any]) -> int:
    """`during()` while a Match of `tokens` reads its blocks from disk; returns the tokens
    that Match hit."""
    tier.gate, tier.reading = threading.Event(), threading.Event()
    hit: list[int] = []

    def match() -> None:
        m = svc.match("e", ns, tokens)
        hit.append(m.num_tokens)
        svc.release("e", [m.lease_id])

    t = threading.Thread(target=match)
    t.start()
    try:
        assert tier.reading.wait(10)
        during()
    finally:
        tier.gate.set()
        t.join(30)
        tier.gate = None
    return hit[0]


def _clear_while_promoting(tier: GatedTier, svc: KVService, ns: str, tokens: bytes) -> int:
    """Clear `ns` while a Match of `tokens` reads its blocks: FailedPrecondition."""

    def clear() -> None:
        with pytest.raises(FailedPrecondition, match="coming up from the disk tier"):
            svc.clear(ns)

    return _while_promoting(tier, svc, ns, tokens, clear)


def _cleared_for_good(svc: KVService, ns: str, tokens: bytes) -> None:
    svc.clear(ns)
    m = svc.match("e", ns, tokens)
    assert m.num_tokens == 0  # nothing came back, from either tier
    svc.release("e", [m.lease_id])
    svc.check_integrity()
    assert svc.stats().disk.blocks == 0


def test_clear_racing_a_promotion_into_a_namespace_without_a_tree(workdir):
    """After a warm restart the namespace has no tree: a Match promoting it pins nothing, so
    the Clear must wait for it (FailedPrecondition; it used to answer OK, dropping C, and A
    came back), and a Clear after it holds."""
    lay = KVLayout(1, 1, 4, "fp32", BS)
    d = os.path.join(workdir, "disk")
    pool, _, svc = _service(d, lay, 6)
    a = _tokens(100, 2)
    _store(svc, pool, "ns", a, 7)
    _store(svc, pool, "ns", _tokens(300, 2), 8)  # C
    _close(pool, svc, write_down=True)
    pool, tier, svc = _service(d, lay, 6, gated=True)
    try:
        assert svc.namespaces() == [] and svc.stats().disk.blocks == 4
        assert _clear_while_promoting(tier, svc, "ns", a) == 2 * BS
        _cleared_for_good(svc, "ns", a)
    finally:
        _close(pool, svc)


def test_clear_racing_a_promotion_of_a_prompt_whose_first_block_is_on_disk(workdir):
    """k = 0: the namespace has a tree (another prompt, unpinned) but the prompt's first block
    is on disk, so the promotion pins nothing in it: Clear answers FailedPrecondition, and a
    Clear after the Match holds (the blocks do not go back on disk)."""
    lay = KVLayout(1, 1, 4, "fp32", BS)
    pool, tier, svc = _service(os.path.join(workdir, "disk"), lay, 6, gated=True)
    try:
        a, b = _tokens(100, 2), _tokens(500, 2)
        _store(svc, pool, "ns", a, 7)
        every = svc.allocate("e", None, "other", 6)  # A demoted
        svc.release("e", [every.lease_id])
        _store(svc, pool, "ns", b, 9)  # the namespace's tree holds B; A is on disk
        assert _clear_while_promoting(tier, svc, "ns", a) == 2 * BS
        _cleared_for_good(svc, "ns", a)
    finally:
        _close(pool, svc)
