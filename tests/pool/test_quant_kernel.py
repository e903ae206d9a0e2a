"""The fused CPU kernel (kvpool/quant_kernel.cpp) against the torch-op codec it replaces on the
CPU: the same pool bytes and the same K/V, bit for bit, on every format, model dtype and block
layout; the fallback when it is disabled or cannot be built."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from kvpool import quant, quant_kernel
from kvpool.errors import InvalidArgument
from kvpool.layout import KVLayout

ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.fixture(autouse=True, scope="module")
def kernel() -> None:
    """Builds the kernel on first use (the suite's first quantized write may have already)."""
    if quant_kernel.disabled() or quant_kernel.ops() is None:
        pytest.skip("the quantized-KV CPU kernel is disabled or cannot be built here")


@contextmanager
def torch_ops() -> Any:
    """The reference path: RADIXKV_NO_KERNEL=1."""
    with mock.patch.dict(os.environ, {"RADIXKV_NO_KERNEL": "1"}):
        yield


def make_layout(dtype: str = "int4", L: int = 2, B: int = 8, H: int = 2, D: int = 8,
                **kw: Any) -> KVLayout:
    return KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, block_size=B, dtype=dtype, **kw)


def make_kv(layout: KVLayout, n: int, seed: int, dtype: torch.dtype, scale: float = 1.0,
            zeros: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random engine-layout K, V [layers, n * block_size, heads, dim]: key channels offset like
    real keys, a share `zeros` of values +0 or -0, a few all-zero and constant heads."""
    g = torch.Generator().manual_seed(seed)
    shape = (layout.num_layers, n * layout.block_size, layout.num_kv_heads, layout.head_dim)
    out = []
    for i in range(2):
        x = torch.randn(shape, generator=g) * scale
        if i == 0:
            x += torch.linspace(-4, 4, layout.head_dim) * scale
        hit = torch.rand(shape, generator=g) < zeros
        signs = torch.where(torch.rand(shape, generator=g) < 0.5, 0.0, -0.0)
        x = torch.where(hit, signs, x)
        if zeros:
            x[:, ::3, 0] = -0.0  # whole (token, head) groups of zeros
            x[:, 1::5, -1] = 0.75 * scale  # constant groups
        out.append(x.to(dtype))
    return out[0], out[1]


def write(layout: KVLayout, num_plain: int, num_sink: int, ids: list[int], k: torch.Tensor,
          v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quant.scatter into fresh regions filled with noise (every byte must be written)."""
    g = torch.Generator().manual_seed(1)
    plain = torch.randint(0, 256, (num_plain, layout.bytes_per_block), generator=g,
                          dtype=torch.uint8)
    sink = torch.randint(0, 256, (num_sink, layout.sink_bytes_per_block), generator=g,
                         dtype=torch.uint8)
    quant.scatter(layout, plain, sink, ids, k, v)
    return plain, sink


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                              b.contiguous().view(torch.uint8))


def check_both_paths(layout: KVLayout, num_plain: int, num_sink: int, ids: list[int],
                     k: torch.Tensor, v: torch.Tensor, out_dtype: torch.dtype | None = None
                     ) -> None:
    plain, sink = write(layout, num_plain, num_sink, ids, k, v)
    got = quant.gather(layout, plain, sink, ids, out_dtype)
    with torch_ops():
        plain_ref, sink_ref = write(layout, num_plain, num_sink, ids, k, v)
        want = quant.gather(layout, plain_ref, sink_ref, ids, out_dtype)
    assert torch.equal(plain, plain_ref) and torch.equal(sink, sink_ref)
    assert same_bytes(got[0], want[0]) and same_bytes(got[1], want[1])


FORMATS = {
    "int8": dict(dtype="int8"),
    "int8-g4": dict(dtype="int8", group_size=4),
    "int4": dict(dtype="int4"),
    "int4-g4": dict(dtype="int4", group_size=4),
    "int4-token-g4": dict(dtype="int4", key_scales="token", group_size=4),
}


@pytest.mark.parametrize("model", DTYPES)
@pytest.mark.parametrize("name", FORMATS)
def test_the_test_suites_cases_match_byte_for_byte(name, model):
    """tests/pool/test_quant.py's geometry: sink blocks first, among and after regular ones."""
    lay = make_layout(model_dtype=model, sink_tokens=2, **FORMATS[name])
    k, v = make_kv(lay, 4, seed=0, dtype=DTYPES[model], zeros=0.1)
    check_both_paths(lay, 6, 2, [6, 0, 1, 7], k, v)
    check_both_paths(lay, 6, 2, [3, 5, 0, 2], k, v)
    check_both_paths(dataclasses.replace(lay, sink_tokens=0), 6, 0, [3, 5, 0, 2], k, v)


@st.composite
def cases(draw: Any) -> tuple[Any, ...]:
    dtype = draw(st.sampled_from(["int8", "int4"]))
    head_dim = draw(st.integers(1, 12)) * (2 if dtype == "int4" else 1)
    group = draw(st.sampled_from([0] + [g for g in range(1, head_dim) if head_dim % g == 0]))
    block_size = draw(st.integers(1, 9))
    lay = make_layout(dtype=dtype, L=draw(st.integers(1, 3)), B=block_size,
                      H=draw(st.integers(1, 3)), D=head_dim, group_size=group,
                      key_scales=draw(st.sampled_from(["channel", "token"])),
                      model_dtype=draw(st.sampled_from(list(DTYPES))),
                      sink_tokens=draw(st.integers(0, block_size - 1)))
    # the torch ops view a sink segment in place: it must start aligned for the model dtype
    assume(lay.bytes_per_block % DTYPES[lay.model_dtype].itemsize == 0)
    num_sink = draw(st.integers(0, 3)) if lay.sink_tokens else 0
    num_plain = draw(st.integers(1, 6))
    ids = draw(st.lists(st.integers(0, num_plain + num_sink - 1), min_size=1, max_size=6,
                        unique=True))
    in_dtype = DTYPES[draw(st.sampled_from(list(DTYPES)))]
    out_dtype = draw(st.sampled_from([None, *DTYPES.values()]))
    scale = 10.0 ** draw(st.integers(-7, 3))
    zeros = draw(st.sampled_from([0.0, 0.3]))
    return lay, num_plain, num_sink, ids, in_dtype, out_dtype, scale, zeros, draw(st.integers())


@given(cases())
def test_random_layouts_match_byte_for_byte(case):
    lay, num_plain, num_sink, ids, in_dtype, out_dtype, scale, zeros, seed = case
    k, v = make_kv(lay, len(ids), seed % 2**31, in_dtype, scale, zeros)
    check_both_paths(lay, num_plain, num_sink, ids, k, v, out_dtype)


@pytest.mark.parametrize("in_dtype", DTYPES)
def test_nan_and_inf_are_refused_with_nothing_written(in_dtype):
    lay = make_layout("int4", model_dtype="bf16", sink_tokens=2)
    k, v = make_kv(lay, 3, seed=2, dtype=DTYPES[in_dtype])
    plain = torch.zeros((4, lay.bytes_per_block), dtype=torch.uint8)
    sink = torch.zeros((2, lay.sink_bytes_per_block), dtype=torch.uint8)
    for bad, where in ((float("nan"), (1, 20, 1, 3)), (float("inf"), (0, 0, 0, 0)),
                       (float("-inf"), (1, 23, 1, 7))):
        for x in (k, v):
            spoiled = x.clone()
            spoiled[where] = bad
            args = (spoiled, v) if x is k else (k, spoiled)
            with pytest.raises(InvalidArgument, match="NaN or Inf"):
                quant.scatter(lay, plain, sink, [4, 0, 2], *args)
            assert not plain.any() and not sink.any()


def test_other_dtypes_and_the_switch_take_the_torch_path(monkeypatch):
    """fp64 K/V (rounded once to the model dtype, as the torch ops do) and RADIXKV_NO_KERNEL=1
    take the torch ops."""
    lay = make_layout("int8", model_dtype="fp16", sink_tokens=0)
    k, v = make_kv(lay, 2, seed=3, dtype=torch.float64)
    plain, _ = write(lay, 2, 0, [1, 0], k, v)
    with torch_ops():
        want, _ = write(lay, 2, 0, [1, 0], k, v)
    assert torch.equal(plain, want)
    calls = []
    monkeypatch.setattr(quant, "_encode_rows", lambda *a: calls.append(a))
    write(lay, 2, 0, [1, 0], k.float(), v.float())
    assert not calls
    monkeypatch.setenv("RADIXKV_NO_KERNEL", "1")
    assert quant_kernel.ops() is None
    write(lay, 2, 0, [1, 0], k.float(), v.float())
    assert len(calls) == 1


def test_a_kernel_that_cannot_build_falls_back_and_says_why_once(monkeypatch, caplog):
    def broken() -> None:
        raise RuntimeError("Error building extension 'radixkv_quant': [1/2] c++ -c q.cpp\n"
                           "q.cpp:10:10: fatal error: ATen/Parallel.h: No such file\n"
                           "ninja: build stopped: subcommand failed.")

    monkeypatch.setattr(quant_kernel.KERNEL, "_loaded", [])
    monkeypatch.setattr(quant_kernel.KERNEL, "_build_and_load", broken)
    lay = make_layout("int4", sink_tokens=0)
    k, v = make_kv(lay, 2, seed=4, dtype=torch.float32)
    with caplog.at_level(logging.WARNING, logger="kvpool.quant_kernel"):
        plain, sink = write(lay, 2, 0, [0, 1], k, v)
        got = quant.gather(lay, plain, sink, [0, 1])
        write(lay, 2, 0, [0, 1], k, v)
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == ["quantized-KV CPU kernel unavailable (q.cpp:10:10: fatal error: "
                        "ATen/Parallel.h: No such file); using the torch-op codec"]
    with torch_ops():
        want_plain, _ = write(lay, 2, 0, [0, 1], k, v)
    assert torch.equal(plain, want_plain) and torch.equal(got[0], quant.gather(
        lay, want_plain, sink, [0, 1])[0])


def test_without_a_compiler_the_torch_ops_serve(tmp_path):
    code = ("import torch; from kvpool import quant, quant_kernel; "
            "from kvpool.layout import KVLayout; "
            "lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, "
            "dtype='int8', model_dtype='fp32'); "
            "plain = torch.zeros((2, lay.bytes_per_block), dtype=torch.uint8); "
            "sink = torch.zeros((0, lay.sink_bytes_per_block), dtype=torch.uint8); "
            "k = torch.randn(1, 8, 1, 8); quant.scatter(lay, plain, sink, [1, 0], k, k); "
            "assert (quant.gather(lay, plain, sink, [1, 0])[0] - k).abs().max() < 0.05; "
            "assert quant_kernel.ops() is None")
    env = {**os.environ, "RADIXKV_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT),
           "CXX": str(tmp_path / "no-such-c++")}
    env.pop("RADIXKV_NO_KERNEL", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("quantized-KV CPU kernel unavailable (no C++ compiler:") == 1


def test_two_processes_build_once_into_the_cache_dir(tmp_path):
    """A fresh cache: two processes ask at once; one compiles (the other waits on the lock), both
    load, and nothing lands in the repository."""
    code = ("from kvpool import quant_kernel; import sys; "
            "sys.exit(0 if quant_kernel.ops() is not None else 1)")
    env = {**os.environ, "RADIXKV_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    env.pop("RADIXKV_NO_KERNEL", None)
    before = _status()
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    errs = [p.communicate(timeout=240)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    assert sum("compiling the quantized-KV CPU kernel" in e for e in errs) == 1, errs
    assert len(list((tmp_path / "kernels").glob("quant-*/built"))) == 1
    assert _status() == before


def _status() -> str:
    return subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True,
                          text=True).stdout
