"""Sliding-window pools (issue 14, item 2, the pool side): full parts and window parts in one
slab and one id space; their sizes and offsets, free lists, reads and writes in one process and
across two, the all-windowed layout's 0-byte full parts, the memory split, the handle and
PoolInfo, `radixkv serve --window-fraction`, and `radixkv replay --memory`.

torch is imported inside the tests that use it: a spawned worker imports this module."""

from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing
import os
import re
from collections import deque
from collections.abc import Iterator
from typing import Any

import pytest
from _server import running_server
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool import BlockPool, PoolHandle, attach, create_pool, num_blocks_for
from kvpool.host import SHM_DIR, HostBlockPool
from kvpool.layout import PRESETS, KVLayout
from kvpool.sizing import (
    IDS_PER_WINDOW_PART,
    default_window_fraction,
    fit_blocks,
    fit_window_blocks,
)
from radixkv.cli.commands.replay import memory_capacity
from radixkv.cli.main import main as cli_main
from radixkv.client import Client, pool_info_from_pb
from radixkv.protocol.errors import IntegrityError, InvalidArgument, OutOfBlocks
from radixkv.server.servicer import Servicer
from radixkv.service import KVService
from radixkv.v1 import radixkv_pb2 as pb

PREFIX = f"rkvw{os.getpid()}"
SPAWN = multiprocessing.get_context("spawn")

# 4 layers x 2 kv heads x head_dim 8, fp16, block 4: 2 x 4 x 2 x 8 x 2 B = 256 B per layer per
# block. Layers 0-2 windowed, layer 3 full: a full part is 256 B, a window part 768 B.
HYBRID = KVLayout(4, 2, 8, "fp16", 4).with_window(6, "0-2")
ALL_WINDOWED = KVLayout(2, 2, 8, "fp16", 4).with_window(6, "all")  # window parts 512 B, full 0


def make_pool(layout: KVLayout = HYBRID, num_blocks: int = 3, **kw: Any) -> BlockPool:
    return create_pool(layout, num_blocks=num_blocks, name_prefix=PREFIX, **kw)


def kv(layers: int, tokens: int, seed: int, dtype: str = "float16") -> tuple[Any, Any]:
    """Distinct engine-layout k, v [layers, tokens, 2, 8]."""
    import torch

    g = torch.Generator().manual_seed(seed)
    shape = (layers, tokens, 2, 8)
    return (torch.randn(shape, generator=g).to(getattr(torch, dtype)),
            torch.randn(shape, generator=g).to(getattr(torch, dtype)))


@pytest.fixture(scope="module", autouse=True)
def no_segment_left() -> Iterator[None]:
    yield
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX)]


# -- regions ---------------------------------------------------------------------------------


def test_part_layouts_by_hand() -> None:
    full, window = HYBRID.full_part(), HYBRID.window_part()
    assert (full.num_layers, window.num_layers) == (1, 3)
    assert not full.is_windowed and not window.is_windowed
    assert dataclasses.replace(full, num_layers=4) == dataclasses.replace(HYBRID.with_window(None))
    assert (full.bytes_per_block, window.bytes_per_block) == (256, 768)
    assert (HYBRID.full_bytes_per_block, HYBRID.window_bytes_per_block) == (256, 768)
    plain = KVLayout(4, 2, 8, "fp16", 4)
    assert plain.full_part() is plain
    with pytest.raises(InvalidArgument, match="has no sliding window: it has no window part"):
        plain.window_part()


def test_region_sizes_and_offsets_by_hand() -> None:
    with make_pool(num_window_blocks=2) as pool:
        assert (pool.num_blocks, pool.num_full_blocks, pool.num_window_blocks) == (5, 3, 2)
        assert pool.slab_bytes == 3 * 256 + 2 * 768
        assert pool.view().shape == (3, 1, 2, 4, 2, 8)
        assert pool.window_view().shape == (2, 3, 2, 4, 2, 8)
        full, window = pool.view(), pool.window_view()
        assert window.data_ptr() - full.data_ptr() == 3 * 256  # right after the full parts
        assert pool.block(4).data_ptr() - full.data_ptr() == 3 * 256 + 768
        assert pool.block(2).shape == (1, 2, 4, 2, 8) and pool.block(3).shape == (3, 2, 4, 2, 8)
        assert [pool.is_window(i) for i in range(5)] == [False] * 3 + [True] * 2
        handle = pool.export()
        assert (handle.num_window_blocks, handle.nbytes) == (2, 4096)  # a page
        assert handle.shape == (3, 1, 2, 4, 2, 8)
        assert handle.strides == (256, 256, 128, 32, 16, 2)
        assert repr(pool).startswith(
            "HostBlockPool(fp16, 3 full parts x 256 B + 2 window parts x 768 B, 3/3 + 2/2 free")


def test_window_count_rules() -> None:
    with pytest.raises(InvalidArgument, match=r"num_window_blocks 0 is not within 1\.\.4: a "
                       "windowed pool of 5 ids needs at least one full part and one window"):
        HostBlockPool(HYBRID, 5, name_prefix=PREFIX)
    with pytest.raises(InvalidArgument, match=r"num_window_blocks 5 is not within 1\.\.4"):
        HostBlockPool(HYBRID, 5, name_prefix=PREFIX, num_window_blocks=5)
    with pytest.raises(InvalidArgument, match="num_window_blocks 2: .* has no sliding window"):
        HostBlockPool(KVLayout(4, 2, 8, "fp16", 4), 5, name_prefix=PREFIX, num_window_blocks=2)
    with pytest.raises(InvalidArgument, match="window parts need a sliding-window layout"):
        create_pool(KVLayout(4, 2, 8, "fp16", 4), num_blocks=4, num_window_blocks=2)
    with make_pool(HYBRID, 2) as pool:  # num_blocks is the full parts; as many window parts
        assert (pool.num_full_blocks, pool.num_window_blocks) == (2, 2)


# -- free lists ------------------------------------------------------------------------------


def test_alloc_window_alloc_and_free_exact_ids() -> None:
    with make_pool(num_blocks=3, num_window_blocks=3) as pool:
        assert pool.alloc(2) == [0, 1]
        assert pool.alloc_window(2) == [3, 4]
        assert (pool.num_free, pool.num_free_window, pool.num_used) == (1, 1, 2)
        pool.free([4, 0])  # a mix: each goes back to its own list
        assert pool.alloc(2) == [2, 0] and pool.alloc_window(2) == [5, 4]
        with pytest.raises(OutOfBlocks, match=r"^asked 1 blocks, 0 free of 3$"):
            pool.alloc(1)
        with pytest.raises(OutOfBlocks, match=r"^asked 1 window parts, 0 free of 3$"):
            pool.alloc_window(1)
        with pytest.raises(InvalidArgument, match=r"^alloc_window needs m >= 1, got 0$"):
            pool.alloc_window(0)
        pool.check_integrity()
        pool.free([0, 1, 2, 3, 4, 5])
        assert (pool.num_free, pool.num_free_window) == (3, 3)
        pool.check_integrity()
        pool._free_window.append(1)  # type: ignore[attr-defined]
        with pytest.raises(IntegrityError, match="on the other region's free list"):
            pool.check_integrity()
    with create_pool(KVLayout(4, 2, 8, "fp16", 4), num_blocks=2, name_prefix=PREFIX) as plain:
        assert plain.num_window_blocks == 0 and not plain.is_window(1)
        assert plain.num_full_blocks == 2 and plain.num_free_window == 0
        with pytest.raises(InvalidArgument, match="alloc_window: this pool has no window parts"):
            plain.alloc_window(1)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda p: p.free([6]), "cannot free 1 blocks: block id 6 out of range 0..5"),
        (lambda p: p.free([3, 3]), "cannot free 2 blocks: block 3 given twice"),
        (lambda p: p.free([5]), "cannot free 1 blocks: block 5 is already free"),
        (lambda p: p.read([3]), "block id 3 is a window part (ids 3..5); read takes full parts "
                                "0..2: use read_window"),
        (lambda p: p.read([6]), "block id 6 out of range 0..2"),
        (lambda p: p.read_window([2]), "block id 2 is a full part (ids 0..2); read_window takes "
                                       "window parts 3..5"),
        (lambda p: p.read_window([-1]), "block id -1 out of range 0..5; read_window takes window "
                                        "parts 3..5"),
        (lambda p: p.write_window([0], *kv(3, 4, 0)), "block id 0 is a full part (ids 0..2); "
                                                      "write_window takes window parts 3..5"),
        (lambda p: p.write([1, 4], *kv(1, 8, 0)), "block id 4 is a window part (ids 3..5); "
                                                  "write takes full parts 0..2: use "
                                                  "write_window"),
        (lambda p: p.block(6), "block id 6 out of range 0..5"),
    ],
)
def test_wrong_region_and_out_of_range_ids(call: Any, message: str) -> None:
    with make_pool(num_blocks=3, num_window_blocks=3) as pool:
        pool.alloc(3)
        pool.alloc_window(2)  # 3 and 4 allocated, 5 free
        before = (list(pool._free), list(pool._free_window))  # type: ignore[attr-defined]
        with pytest.raises(InvalidArgument, match=f"^{re.escape(message)}$"):
            call(pool)
        assert (list(pool._free), list(pool._free_window)) == before  # type: ignore[attr-defined]
        pool.check_integrity()


class TwoFreeListsMachine(RuleBasedStateMachine):
    """Both free lists against two plain deques: exact ids, FIFO reuse, `free` of any mix."""

    F, W = 4, 3

    def __init__(self) -> None:
        super().__init__()
        self.pool = make_pool(HYBRID, self.F, num_window_blocks=self.W)
        self.full: deque[int] = deque(range(self.F))
        self.window: deque[int] = deque(range(self.F, self.F + self.W))

    def used(self) -> list[int]:
        return sorted(set(range(self.F + self.W)) - set(self.full) - set(self.window))

    @rule(n=st.integers(1, 5))
    def alloc(self, n: int) -> None:
        if n > len(self.full):
            with pytest.raises(OutOfBlocks, match=f"asked {n} blocks, {len(self.full)} free"):
                self.pool.alloc(n)
            return
        assert self.pool.alloc(n) == [self.full.popleft() for _ in range(n)]

    @rule(m=st.integers(1, 4))
    def alloc_window(self, m: int) -> None:
        if m > len(self.window):
            with pytest.raises(OutOfBlocks, match=f"asked {m} window parts, "
                               f"{len(self.window)} free of {self.W}"):
                self.pool.alloc_window(m)
            return
        assert self.pool.alloc_window(m) == [self.window.popleft() for _ in range(m)]

    @precondition(lambda self: self.used())
    @rule(data=st.data())
    def free_some(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from(self.used()), unique=True, min_size=1))
        self.pool.free(ids)
        for i in ids:
            (self.window if i >= self.F else self.full).append(i)

    @invariant()
    def consistent(self) -> None:
        self.pool.check_integrity()
        assert (self.pool.num_free, self.pool.num_free_window) == (len(self.full),
                                                                   len(self.window))
        assert list(self.pool._free) == list(self.full)  # type: ignore[attr-defined]
        assert list(self.pool._free_window) == list(self.window)  # type: ignore[attr-defined]

    def teardown(self) -> None:
        self.pool.close()


TwoFreeListsMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=20, deadline=None
)
test_two_free_lists_machine = TwoFreeListsMachine.TestCase


# -- reads and writes ------------------------------------------------------------------------


def test_read_write_each_part_in_place() -> None:
    import torch

    with make_pool(num_blocks=3, num_window_blocks=2) as pool:
        kf, vf = kv(1, 8, seed=1)
        kw, vw = kv(3, 4, seed=2)
        pool.write([2, 0], kf, vf)
        pool.write_window([4], kw, vw)
        full, window = pool.view(), pool.window_view()
        assert torch.equal(full[2, 0, 0], kf[0, :4]) and torch.equal(full[0, 0, 1], vf[0, 4:])
        assert torch.equal(window[1, :, 0], kw) and torch.equal(window[1, :, 1], vw)
        assert not full[1].any() and not window[0].any()  # untouched
        assert all(torch.equal(a, b) for a, b in zip(pool.read([2, 0]), (kf, vf), strict=True))
        assert all(torch.equal(a, b) for a, b in zip(pool.read_window([4]), (kw, vw),
                                                     strict=True))
        pool.write([1], kf[:, :4].float(), vf[:, :4].float())  # converted to the pool's dtype
        assert torch.equal(pool.read([1])[0], kf[:, :4])


def _attached_worker(handle: dict[str, Any], results: Any) -> None:
    """Read full parts 2, 0 and window part 4; write full part 1 and window part 3."""
    try:
        with attach(handle) as mapping:
            out = [t.numpy().tobytes() for t in (*mapping.read([2, 0]), *mapping.read_window([4]))]
            mapping.write([1], *kv(1, 4, seed=3))
            mapping.write_window([3], *kv(3, 4, seed=4))
            results.put((mapping.num_full_blocks, mapping.num_window_blocks, out))
    except BaseException as e:  # report instead of dying silently
        results.put(repr(e))


def test_a_second_process_reads_and_writes_both_parts() -> None:
    import torch

    with make_pool(num_blocks=3, num_window_blocks=2) as pool:
        kf, vf = kv(1, 8, seed=1)
        kw, vw = kv(3, 4, seed=2)
        pool.write([2, 0], kf, vf)
        pool.write_window([4], kw, vw)
        results = SPAWN.Queue()
        proc = SPAWN.Process(target=_attached_worker, args=(pool.export().to_dict(), results))
        proc.start()
        got = results.get(timeout=120)
        proc.join(60)
        assert proc.exitcode == 0, got
        num_full, num_window, raw = got
        assert (num_full, num_window) == (3, 2)
        assert raw == [t.numpy().tobytes() for t in (kf, vf, kw, vw)]
        for (a, b), (c, d) in ((pool.read([1]), kv(1, 4, seed=3)),
                               (pool.read_window([3]), kv(3, 4, seed=4))):
            assert torch.equal(a, c) and torch.equal(b, d)


def test_quantized_parts_use_the_codec_per_part() -> None:
    import torch

    from kvpool import quant

    lay = KVLayout(4, 2, 8, "int8", 4, model_dtype="fp32").with_window(6, "0-2")
    assert (lay.full_bytes_per_block, lay.window_bytes_per_block) == (160, 480)  # 128 + 2 x 16
    with make_pool(lay, 2, num_window_blocks=2) as pool:
        assert pool.view().shape == (2, 160) and pool.window_view().shape == (2, 480)
        kw, vw = kv(3, 8, seed=5, dtype="float32")
        pool.write_window([3, 2], kw, vw)
        blocks = torch.stack((kw, vw), 1).view(3, 2, 2, 4, 2, 8).permute(2, 0, 1, 3, 4, 5)
        want = quant.roundtrip(lay.window_part(), blocks.contiguous(), sinks=False)
        k, v = pool.read_window([3, 2])
        assert torch.equal(k, want[:, :, 0].permute(1, 0, 2, 3, 4).reshape(3, 8, 2, 8))
        assert torch.equal(v, want[:, :, 1].permute(1, 0, 2, 3, 4).reshape(3, 8, 2, 8))
        kf, vf = kv(1, 4, seed=6, dtype="float32")
        pool.write([1], kf, vf)
        assert (pool.read([1])[0] - kf).abs().max() < 0.05


def test_sink_tokens_with_a_window_are_refused() -> None:
    lay = KVLayout(4, 2, 8, "int8", 4, sink_tokens=2).with_window(6, "0-2")
    message = (r"sink tokens \(2\) with a sliding window are not supported yet: a windowed "
               r"pool's quantized parts keep no sink tokens \(sink_tokens=0")
    with pytest.raises(InvalidArgument, match=message):
        make_pool(lay, 2)
    with pytest.raises(InvalidArgument, match=message):
        HostBlockPool(lay, 4, name_prefix=PREFIX, num_sink_blocks=1, num_window_blocks=2)


# -- all-windowed: 0-byte full parts ---------------------------------------------------------


def test_all_windowed_full_parts_take_no_memory() -> None:
    import torch

    full = ALL_WINDOWED.full_part()
    assert (full.num_layers, full.bytes_per_block, full.layer_bytes_per_block) == (0, 0, 0)
    with pytest.raises(InvalidArgument, match="num_layers must be a positive integer"):
        dataclasses.replace(full)  # only full_part() makes a 0-layer layout
    with pytest.raises(InvalidArgument, match="takes 0 bytes per block"):
        num_blocks_for(full, 4096)
    with pytest.raises(InvalidArgument, match="takes 0 bytes per block"):
        full.tokens_in(4096)
    assert default_window_fraction(ALL_WINDOWED) == 1.0
    assert fit_window_blocks(ALL_WINDOWED, 4096) == (IDS_PER_WINDOW_PART * 8, 8)
    with create_pool(ALL_WINDOWED, memory_bytes=4096, name_prefix=PREFIX) as pool:
        assert (pool.num_full_blocks, pool.num_window_blocks) == (128, 8)
        assert pool.slab_bytes == 8 * 512 and pool.export().nbytes == 4096
        assert pool.view().shape == (128, 0, 2, 4, 2, 8)
        k, v = pool.read([0, 127])
        assert k.shape == v.shape == (0, 8, 2, 8)
        pool.write([5], torch.empty(0, 4, 2, 8), torch.empty(0, 4, 2, 8))
        kw, vw = kv(2, 4, seed=7)
        pool.write_window([135], kw, vw)
        assert torch.equal(pool.read_window([135])[0], kw)
        assert pool.alloc(128) == list(range(128)) and pool.alloc_window(1) == [128]
    with make_pool(ALL_WINDOWED, 4) as pool:  # num_blocks: full parts, as many window parts
        assert (pool.num_blocks, pool.slab_bytes) == (8, 4 * 512)


# -- sizing ----------------------------------------------------------------------------------


def test_memory_split_by_hand() -> None:
    # A 4,096-token conversation: 1,024 full parts (256 B) and its last 2 window parts (768 B).
    assert default_window_fraction(HYBRID) == pytest.approx(2 * 768 / (1024 * 256 + 2 * 768))
    fraction = default_window_fraction(HYBRID)
    assert fit_window_blocks(HYBRID, 1 << 20) == (
        ((1 << 20) - 7 * 768) // 256, int((1 << 20) * fraction) // 768)  # (4075, 7)
    assert fit_window_blocks(HYBRID, 16384, 0.5) == (34, 10)  # 8,192 B buy 10 x 768
    with create_pool(HYBRID, memory_bytes=16384, window_fraction=0.5,
                     name_prefix=PREFIX) as pool:
        assert (pool.num_full_blocks, pool.num_window_blocks) == (34, 10)
        assert pool.slab_bytes == 34 * 256 + 10 * 768 == 16384
    with make_pool(HYBRID, 6, window_fraction=0.5) as pool:  # 6 x 256 B of full parts: 2 x 768 B
        assert (pool.num_full_blocks, pool.num_window_blocks) == (6, 2)
    with pytest.raises(InvalidArgument, match="holds 3 full parts of 256 bytes and 0 window "
                       "parts of 768 bytes: a windowed pool needs at least one of each"):
        fit_window_blocks(HYBRID, 1000, 0.5)
    with pytest.raises(InvalidArgument, match="size it with fit_window_blocks"):
        fit_blocks(HYBRID, 1 << 20)
    with pytest.raises(InvalidArgument, match="num_window_blocks goes with num_blocks"):
        create_pool(HYBRID, memory_bytes=1 << 20, num_window_blocks=2)


def test_preset_window_fractions() -> None:
    # gemma-3-like: 256 blocks x 8 full layers against 64 window blocks x 40 windowed layers.
    assert default_window_fraction(PRESETS["gemma-3-like"]) == pytest.approx(
        64 * 40 / (256 * 8 + 64 * 40))
    # gpt-oss-like: 256 x 12 full against 8 x 12 windowed.
    assert default_window_fraction(PRESETS["gpt-oss-like"]) == pytest.approx(8 / (256 + 8))
    assert default_window_fraction(PRESETS["mistral-7b-v0.1"]) == 1.0
    with pytest.raises(InvalidArgument, match="has no sliding window"):
        default_window_fraction(PRESETS["llama-3-8b"])


@pytest.mark.parametrize(
    ("layout", "kw", "message"),
    [
        (HYBRID, dict(window_fraction=0.0), "window fraction must be between 0 and 1"),
        (HYBRID, dict(window_fraction=1.0), "window fraction must be between 0 and 1"),
        (HYBRID, dict(window_fraction=math.nan), "window fraction must be between 0 and 1"),
        (ALL_WINDOWED, dict(window_fraction=0.5), "its full parts take no memory, so it must "
                                                  "be 1"),
        (HYBRID, dict(num_window_blocks=2, window_fraction=0.5),
         "give num_window_blocks or window_fraction, not both"),
        (HYBRID, dict(num_window_blocks=0), "num_window_blocks must be >= 1, got 0"),
    ],
)
def test_bad_window_sizes(layout: KVLayout, kw: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        make_pool(layout, 4, **kw)


# -- the handle and PoolInfo -----------------------------------------------------------------

PLAIN_HANDLE_KEYS = {"backend", "name", "nbytes", "num_blocks", "layout", "epoch", "ipc_handle",
                     "device_id", "device_uuid", "owner_pid", "num_sink_blocks"}


def test_handle_round_trips_and_non_windowed_is_unchanged() -> None:
    with make_pool(num_window_blocks=2) as pool:
        handle = pool.export()
        data = json.loads(json.dumps(handle.to_dict()))
        assert set(data) == PLAIN_HANDLE_KEYS | {"num_window_blocks"}
        assert data["num_window_blocks"] == 2 and PoolHandle.from_dict(data) == handle
        with pytest.raises(InvalidArgument, match="not within 1..4"):
            PoolHandle.from_dict({**data, "num_window_blocks": 5})
    with create_pool(KVLayout(4, 2, 8, "fp16", 4), num_blocks=4, name_prefix=PREFIX) as plain:
        data = plain.export().to_dict()
        assert set(data) == PLAIN_HANDLE_KEYS  # as before windowed pools
        assert PoolHandle.from_dict(data).num_window_blocks == 0  # absent: 0
        with pytest.raises(InvalidArgument, match="has no sliding window"):
            PoolHandle.from_dict({**data, "num_window_blocks": 2})


def test_pool_info_carries_the_window_region_only_when_there_is_one() -> None:
    for layout, window in ((HYBRID, 2), (KVLayout(4, 2, 8, "fp16", 4), 0)):
        with make_pool(layout, 3, **({"num_window_blocks": 2} if window else {})) as pool:
            response = Servicer(KVService(pool), 1 << 20).PoolInfo(pb.PoolInfoRequest(), None)
            names = {f.name for f, _ in response.ListFields()}
            assert ("num_window_blocks" in names) == bool(window)
            assert response.num_window_blocks == window
            assert pool_info_from_pb(response).handle == pool.export()


def test_serve_splits_memory_and_pool_info_says_so() -> None:
    # tests/_server.py's model: 2 layers, fp32, block 4: 512 B per layer per block; alternate:
    # layer 0 windowed. 8 KiB at 0.25: 2 KiB of window parts (4), 6 KiB of full parts (12).
    with running_server("--sliding-window", "6", "--window-layers", "alternate", "--memory",
                        "8KiB", "--window-fraction", "0.25") as server, \
            Client(server.socket) as client:
        assert server.banner.split(": ", 1)[1].startswith(
            "host pool, 12 full parts x 512 B + 4 window parts x 512 B (4 tokens each)")
        handle = client.pool_info().handle
        assert (handle.num_blocks, handle.num_window_blocks, handle.nbytes) == (16, 4, 8192)
        with attach(handle) as mapping:
            k, v = kv(1, 8, seed=8, dtype="float32")
            mapping.write_window([15, 12], k, v)
            assert all(a.equal(b) for a, b in zip(mapping.read_window([15, 12]), (k, v),
                                                   strict=True))
            assert mapping.view().shape == (12, 1, 2, 4, 2, 8)


@pytest.mark.parametrize(
    ("preset", "value", "message"),
    [
        ("llama-3.2-1b", "0.5", "--window-fraction 0.5 needs a sliding-window layout"),
        ("gemma-3-like", "0", "--window-fraction 0: window fraction must be between 0 and 1"),
        ("gemma-3-like", "1", "--window-fraction 1: window fraction must be between 0 and 1"),
        ("gemma-3-like", "nan", "--window-fraction nan: window fraction must be between"),
        ("gemma-3-like", "half", "--window-fraction half: could not convert"),
        ("mistral-7b-v0.1", "0.5", "its full parts take no memory, so it must be 1"),
    ],
)
def test_serve_refuses_bad_window_fractions(preset: str, value: str, message: str,
                                            capsys: pytest.CaptureFixture[str],
                                            tmp_path: Any) -> None:
    # Refused while parsing, before any pool or socket: in this process.
    rc = cli_main(["serve", "--preset", preset, "--window-fraction", value, "--socket",
                   str(tmp_path / "s.sock")])
    assert rc == 2
    assert message in capsys.readouterr().err


# -- replay --memory -------------------------------------------------------------------------


def test_replay_memory_counts_both_regions() -> None:
    gemma = PRESETS["gemma-3-like"]
    counted = memory_capacity("gemma-3-like", "bf16", 16, "1GiB", 0.125)
    assert (counted.blocks, counted.window_blocks) == fit_window_blocks(gemma, 1 << 30)
    assert f"holds {counted.blocks:,} full parts and {counted.window_blocks:,} window parts" \
        in counted.note
    quantized = memory_capacity("gemma-3-like", "int8", 16, "1GiB", 0.125)  # no sink tokens
    assert quantized.blocks > counted.blocks and quantized.sink_fraction == 0.0
    plain = memory_capacity("llama-3-8b", "bf16", 16, "1GiB", 0.125)
    assert (plain.blocks, plain.window_blocks, plain.note) == (512, 0, "")  # 2 MiB blocks
