"""Quantized writes at the edge of what fp16 scales hold, on both codecs (the CPU kernel and the
torch ops): finite K/V whose scale or minimum still fits come back finite and close; beyond
that the write is refused (InvalidArgument) and no pool byte changes, never stored as NaN/Inf."""

from __future__ import annotations

import pytest
import torch
from test_quant import FORMATS, B, D, H, L, layout

from kvpool import create_pool
from radixkv.protocol.errors import InvalidArgument

# (value written at one (token, head, channel), the rest in [-1, 1]) per format: inside / beyond
INSIDE = {"int8": [8.0e6, -8.0e6], "int4": [6.0e4, -6.0e4],
          "int4-token-g4": [6.0e4, -6.0e4]}
BEYOND = {"int8": [1e7, -1e7, 3e38],
          "int4": [-7e4, 1e6, 3e38],  # the minimum overflows; the range does
          "int4-token-g4": [-7e4, 1e6, -3e38]}


def kv_with(value: float, where: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    k = torch.rand((L, 2 * B, H, D), generator=g) * 2 - 1
    v = torch.rand((L, 2 * B, H, D), generator=g) * 2 - 1
    k[where] = value
    v[where] = value
    return k, v


@pytest.mark.parametrize("no_kernel", ["0", "1"])  # the CPU kernel, the torch ops
@pytest.mark.parametrize("name", FORMATS)
def test_values_fp16_scales_hold_come_back_finite(monkeypatch, name, no_kernel):
    monkeypatch.setenv("RADIXKV_NO_KERNEL", no_kernel)
    with create_pool(layout(name, sinks=0), num_blocks=4) as pool:
        for value in INSIDE[name]:
            k, v = kv_with(value, (1, 11, 1, 5))
            pool.write([2, 0], k, v)
            back_k, back_v = pool.read([2, 0])
            for want, got in ((k, back_k), (v, back_v)):
                assert bool(torch.isfinite(got).all()), f"{value:g} read back non-finite"
                # int4's 16 levels over a range of |value|: an error of about value / 30
                assert float((got - want).abs().max()) <= abs(value) / 15


@pytest.mark.parametrize("no_kernel", ["0", "1"])
@pytest.mark.parametrize("name", FORMATS)
def test_values_beyond_fp16_scales_are_refused_and_nothing_written(monkeypatch, name,
                                                                   no_kernel):
    monkeypatch.setenv("RADIXKV_NO_KERNEL", no_kernel)
    with create_pool(layout(name, sinks=2), num_blocks=4, sink_fraction=0.5) as pool:
        k, v = kv_with(0.5, (0, 0, 0, 0))
        pool.write([0, 3], k, v)  # a plain and a sink block, written once
        before = pool.view().clone(), pool.sink_view().clone()
        for value in BEYOND[name]:
            for where in ((1, 11, 1, 5), (0, 2 * B - 1, 0, 0)):
                k, v = kv_with(value, where)
                with pytest.raises(InvalidArgument, match="fp16"):
                    pool.write([0, 3], k, v)
                with pytest.raises(InvalidArgument, match="fp16"):
                    pool.write([1, 3], k.clone().fill_(0.25), v)  # in V only
                assert torch.equal(pool.view(), before[0])
                assert torch.equal(pool.sink_view(), before[1])
        k, v = pool.read([0, 3])
        assert bool(torch.isfinite(k).all() and torch.isfinite(v).all())
