"""The native page copy (radixkv/integrations/pages_kernel.cpp) against the torch-op copies it
replaces, bit for bit, both ways: vLLM's CPU page interiors (AMX: K and V packed in pairs; the
AVX-512 `vec` pages: keys dim-major; plain [2 * block, dim] pages) written by a reference cache
write (the probe then finds them as with vLLM), in bf16, fp16 and fp32, with random page and
block ids, layers in one storage or apart, whole or one layer at a time as the loader copies.
The same copies against vLLM's own cache-write op are in tests/integrations/vllm/test_vllm.py."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from radixkv.integrations import pages_kernel
from radixkv.integrations.layout import CacheWrite, ProbedPages

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@pytest.fixture(autouse=True, scope="module")
def kernel() -> None:
    if pages_kernel.KERNEL.ops() is None:
        pytest.skip("the paged-KV copy kernel is disabled or cannot be built here")


def position(kind: str, b: int, d: int, t: torch.Tensor, h: torch.Tensor, x: torch.Tensor,
             v: int) -> torch.Tensor:
    """Where (token t, head h, dim x) of K (v=0) or V (v=1) lies in a page
    [heads, block, 2 * dim], flat, as vLLM's CPU kernels store it (cpu_attn.py)."""
    head = h * 2 * b * d
    if kind == "plain":  # [2 * block, dim]: the block's keys, then its values
        return head + v * b * d + t * d + x
    if kind == "vec":  # keys dim-major, values token-major
        return head + (x * b + t if v == 0 else b * d + t * d + x)
    # amx: keys in 16-token rows of dim pairs, values in dim-16 columns of token pairs
    if v == 0:
        return head + t // 16 * 16 * d + x // 2 * 32 + t % 16 * 2 + x % 2
    return head + b * d + x // 16 * 16 * b + t // 2 * 32 + x % 16 * 2 + t % 2


def cache_write(kind: str, heads: int, b: int, d: int) -> CacheWrite:
    """A reference engine cache write: K, V [tokens, heads, dim] into `slots` of `page`."""
    t, h, x = (a.reshape(-1) for a in torch.meshgrid(
        torch.arange(b), torch.arange(heads), torch.arange(d), indexing="ij"))
    where = [position(kind, b, d, t, h, x, v) for v in (0, 1)]

    def write(k: torch.Tensor, v: torch.Tensor, page: torch.Tensor, slots: torch.Tensor) -> None:
        flat = page.view(page.shape[0], -1)
        for s in range(0, slots.numel(), b):
            p = int(slots[s]) // b
            for half, kv in enumerate((k, v)):
                flat[p, where[half]] = kv[s:s + b].reshape(-1)

    return write


def layers_of(n_layers: int, pages: int, heads: int, b: int, d: int, dtype: torch.dtype,
              stacked: bool, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if stacked:  # vLLM: every layer in one storage
        store = torch.randn(n_layers, pages, heads, b, 2 * d, generator=g).to(dtype)
        return list(store.unbind(0))
    return [torch.randn(pages, heads, b, 2 * d, generator=g).to(dtype) for _ in range(n_layers)]


@st.composite
def cases(draw: st.DrawFn) -> dict[str, object]:
    kind = draw(st.sampled_from(["amx", "vec", "plain"]))
    b = draw(st.sampled_from([16, 32, 64] if kind == "amx" else [2, 16, 48]))
    d = draw(st.sampled_from([16, 32, 64] if kind == "amx" else [2, 8, 64]))
    num_pages, num_blocks = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    n = draw(st.integers(0, min(num_pages, num_blocks)))
    return {"kind": kind, "b": b, "d": d, "heads": draw(st.integers(1, 3)),
            "dtype": draw(st.sampled_from(DTYPES)), "layers": draw(st.integers(1, 3)),
            "num_pages": num_pages, "num_blocks": num_blocks,
            "pages": draw(st.permutations(range(num_pages)))[:n],
            "blocks": draw(st.permutations(range(num_blocks)))[:n],
            "stacked": draw(st.booleans()), "seed": draw(st.integers(0, 2**16))}


def probed(c: dict[str, object]) -> ProbedPages:
    heads, b, d = int(c["heads"]), int(c["b"]), int(c["d"])  # type: ignore[call-overload]
    write = cache_write(str(c["kind"]), heads, b, d)
    pages = ProbedPages.probe(write, heads, b, d, c["dtype"])  # type: ignore[arg-type]
    assert pages.strided is not None
    return pages


@given(cases())
def test_kernel_copies_equal_the_torch_copies_both_ways(c):
    pages = probed(c)
    heads, b, d, dt = c["heads"], c["b"], c["d"], c["dtype"]
    layers = layers_of(c["layers"], c["num_pages"], heads, b, d, dt, c["stacked"], c["seed"])
    g = torch.Generator().manual_seed(c["seed"] + 1)
    pool = torch.randn(c["num_blocks"], c["layers"], 2, b, heads, d, generator=g).to(dt)
    ids = (c["pages"], c["blocks"])
    others = [replace(pages, kernel=False, write=None),  # strided views
              replace(pages, kernel=False, strided=None)]  # the index gather / scatter
    # saves: engine pages into pool blocks (the kernel's path taken: True)
    saved = pool.clone()
    assert pages._copy_kernel(layers, ids[0], saved, ids[1], to_pool=True) or not ids[0]
    for way in others:
        want = pool.clone()
        way.to_pool(layers, ids[0], want, ids[1])
        assert torch.equal(saved.view(torch.uint8), want.view(torch.uint8))
    # loads: pool blocks into engine pages, whole and one layer at a time (the loader's calls)
    loaded = [kv.clone() for kv in layers]
    assert pages._copy_kernel(loaded, ids[0], pool, ids[1], to_pool=False) or not ids[0]
    one_by_one = [kv.clone() for kv in layers]
    for i, kv in enumerate(one_by_one):
        pages.from_pool([kv], ids[0], pool[:, i:i + 1], ids[1])
    for way in [*others, replace(pages, kernel=False)]:  # the last: the cache write
        want = [kv.clone() for kv in layers]
        way.from_pool(want, ids[0], pool, ids[1])
        for got in (loaded, one_by_one):
            assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8))
                       for x, y in zip(got, want, strict=True))


def test_every_bit_pattern_is_moved_unchanged():
    """NaN payloads, infinities and -0 travel as bytes (no conversion through floats)."""
    c = {"kind": "amx", "b": 32, "d": 32, "heads": 2, "dtype": torch.bfloat16}
    pages = probed(c)
    layer = torch.randint(-2**15, 2**15, (3, 2, 32, 64), dtype=torch.int16).view(torch.bfloat16)
    pool = torch.zeros(2, 1, 2, 32, 2, 32, dtype=torch.bfloat16)
    pages.to_pool([layer], [2, 0], pool, [1, 0])
    back = torch.zeros_like(layer)
    pages.from_pool([back], [2, 0], pool, [1, 0])
    assert torch.equal(back[[2, 0]].view(torch.int16), layer[[2, 0]].view(torch.int16))
    assert not back[1].view(torch.int16).any()


def test_ids_out_of_range_are_refused_before_anything_is_written():
    c = {"kind": "amx", "b": 16, "d": 16, "heads": 1, "dtype": torch.float16}
    pages = probed(c)
    layers = [torch.zeros(2, 1, 16, 32, dtype=torch.float16) for _ in range(2)]
    pool = torch.ones(2, 2, 2, 16, 1, 16, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="page 2 is not in the engine's 2"):
        pages.from_pool(layers, [0, 2], pool, [0, 1])
    with pytest.raises(RuntimeError, match="block 5 is not in the pool view's 2"):
        pages.from_pool(layers, [0, 1], pool, [0, 5])
    assert not any(kv.any() for kv in layers)


def test_the_copy_releases_the_gil():
    """Another Python thread runs while a long copy is under way (the vLLM connector's loader
    copies beside the engine's forward)."""
    c = {"kind": "amx", "b": 128, "d": 64, "heads": 3, "dtype": torch.bfloat16}
    pages = probed(c)
    kv = torch.zeros(64, 3, 128, 128, dtype=torch.bfloat16)
    pool = torch.zeros(64, 1, 2, 128, 3, 64, dtype=torch.bfloat16)
    ids = list(range(64)) * 30
    span: list[float] = []
    ticks: list[float] = []

    def copy() -> None:
        span.append(time.perf_counter())
        pages.from_pool([kv], ids, pool, ids)
        span.append(time.perf_counter())

    th = threading.Thread(target=copy)
    th.start()
    while th.is_alive():
        ticks.append(time.perf_counter())
    th.join()
    start, end = span
    assert end - start > 0.02, "the copy was too short to tell"
    assert any(start + (end - start) / 2 < t < end for t in ticks), \
        "no Python ran during the second half of the copy: it held the GIL"


def test_disabled_or_unbuildable_the_torch_copies_serve(monkeypatch, caplog):
    c = {"kind": "amx", "b": 16, "d": 16, "heads": 2, "dtype": torch.bfloat16}
    pages = probed(c)
    layers = layers_of(2, 3, 2, 16, 16, torch.bfloat16, True, seed=5)
    pool = torch.randn(3, 2, 2, 16, 2, 16).to(torch.bfloat16)
    want = [kv.clone() for kv in layers]
    replace(pages, kernel=False).from_pool(want, [2, 0], pool, [0, 1])
    calls: list[object] = []
    real = pages_kernel.copy

    def spy(*args: object, **kw: object) -> bool:
        done = real(*args, **kw)  # type: ignore[arg-type]
        calls.append(done)
        return done

    monkeypatch.setattr(pages_kernel, "copy", spy)
    with mock.patch.dict(os.environ, {"RADIXKV_NO_KERNEL": "1"}):
        assert pages_kernel.ops() is None
        got = [kv.clone() for kv in layers]
        pages.from_pool(got, [2, 0], pool, [0, 1])
    assert calls == [False] and all(map(torch.equal, got, want))

    def broken() -> None:
        raise RuntimeError("Error building extension 'radixkv_pages': [1/2] c++ -c p.cpp\n"
                           "p.cpp:3:10: fatal error: torch/library.h: No such file\n")

    monkeypatch.setattr(pages_kernel.KERNEL, "_loaded", [])
    monkeypatch.setattr(pages_kernel.KERNEL, "_build_and_load", broken)
    with caplog.at_level(logging.WARNING, logger="radixkv.integrations.pages_kernel"):
        for _ in range(2):
            got = [kv.clone() for kv in layers]
            pages.from_pool(got, [2, 0], pool, [0, 1])
            assert all(map(torch.equal, got, want))
    assert [r.getMessage() for r in caplog.records] == [
        "paged-KV copy kernel unavailable (p.cpp:3:10: fatal error: torch/library.h: No such "
        "file); using the torch-op copies"]


def test_a_plan_reaching_outside_a_page_or_block_is_refused():
    """The kernel checks the plan against the tensors it is given (it is memory-safe whatever
    the caller passes): a loop past the page, a negative offset, a plan cut short."""
    ops = pages_kernel.ops()
    kv = torch.zeros(2, 1, 16, 32, dtype=torch.float16)
    pool = torch.zeros(2, 1, 2, 16, 1, 16, dtype=torch.float16)
    ids = torch.tensor([0, 1])
    fine = [16, 0, 0, 1, 16, 16, 16] + [16, 256, 256, 1, 16, 16, 16]  # plain [2 * block, dim]
    ops.copy_pages([kv], pool, ids, ids, fine, False)
    for bad, match in (([16, 0, 0, 1, 33, 16, 16] + fine[7:], "beyond a page or a block"),
                       ([16, -16, 0, 1, 16, 16, 16] + fine[7:], "offsets -32"),
                       (fine[:9], "the plan ends early")):
        with pytest.raises(RuntimeError, match=match):
            ops.copy_pages([kv], pool, ids, ids, bad, False)


OVERFLOWING = textwrap.dedent("""
    import torch
    from radixkv.integrations import pages_kernel
    kv = torch.zeros(2, 1, 16, 32, dtype=torch.float16)
    pool = torch.zeros(2, 1, 2, 16, 1, 16, dtype=torch.float16)
    ids = torch.tensor([0, 1])
    v = [16, 256, 256, 1, 16, 16, 16]
    for k in ([16, 0, 0, 1, 2**62 + 1, 8, 8], [2**62, 0, 0, 0], [16, 0, 0, 1, 2**40, 0, 0]):
        try:
            pages_kernel.ops().copy_pages([kv], pool, ids, ids, k + v, False)
        except RuntimeError as e:
            print(str(e).splitlines()[0])
""")


def test_a_plan_whose_arithmetic_overflows_is_refused():
    """A loop of 2**62 + 1 x 16 B wraps int64 to an extent that fits, a unit of 2**62 elements
    wraps its bytes, 2**40 passes of one 32-byte unit stay in bounds: each is refused with a
    message (in a subprocess, where a crash shows as a signal), nothing run."""
    out = subprocess.run([sys.executable, "-c", OVERFLOWING], capture_output=True, text=True,
                         timeout=120, env={**os.environ,
                                           "PYTHONPATH": str(Path(__file__).parents[3])})
    assert out.returncode == 0, f"exited {out.returncode}:\n{out.stderr[-2000:]}"
    assert out.stdout.splitlines() == [
        "copy_pages: the plan overflows (4611686018427387904 x 16)",
        "copy_pages: the plan overflows (4611686018427387904 x 2)",
        "copy_pages: the plan moves 35184372088832 bytes per half, more than a block's 1024"]
