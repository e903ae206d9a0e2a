"""Block formats as codecs: every dtype has one, and the engine-facing read/write of a pool works
the same way for every format, from the owner and from a mapping in another process."""

from __future__ import annotations

import multiprocessing
from typing import Any

import pytest
import torch

from kvpool import attach, create_pool
from kvpool.codecs import CODECS, Int4Codec, Int8Codec, PlainCodec, codec_for
from kvpool.layout import DTYPE_BITS, KVLayout
from kvpool.window import SlidingWindow

L, H, D, B = 2, 2, 8, 4
TORCH = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
         "fp8": torch.float8_e4m3fn}


def make_layout(dtype: str, **kw: Any) -> KVLayout:
    if dtype in ("int8", "int4"):
        kw.setdefault("model_dtype", "fp32")
    return KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype=dtype, block_size=B, **kw)


def make_kv(n: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn((L, n * B, H, D), generator=g).to(dtype) for _ in range(2))
    return k, v


def test_every_dtype_has_its_codec() -> None:
    assert set(CODECS) == set(DTYPE_BITS)
    expected = {"fp32": PlainCodec, "fp16": PlainCodec, "bf16": PlainCodec, "fp8": PlainCodec,
                "int8": Int8Codec, "int4": Int4Codec}
    assert {d: type(codec_for(make_layout(d))) for d in DTYPE_BITS} == expected


@pytest.mark.parametrize("dtype", sorted(DTYPE_BITS))
def test_the_view_has_the_handles_shape(dtype: str) -> None:
    with create_pool(make_layout(dtype), num_blocks=5) as pool:
        handle = pool.export()
        assert tuple(pool.view().shape) == handle.shape
        assert pool.numpy_view().shape == handle.shape
        assert tuple(s * pool.view().element_size() for s in pool.view().stride()) == \
            handle.strides


def _read_in_child(handle: dict[str, Any], ids: list[int], queue: Any) -> None:
    with attach(handle) as mapping:
        k, v = mapping.read(ids)
        queue.put((k.float().numpy().tobytes(), v.float().numpy().tobytes()))


@pytest.mark.parametrize("dtype", sorted(DTYPE_BITS))
def test_one_read_write_api_for_every_format(dtype: str) -> None:
    """write then read, on the owner and on another process's mapping: plain formats give the
    values back bit for bit (as the pool's dtype), quantized ones within their error."""
    lay = make_layout(dtype, sink_tokens=2 if dtype in ("int8", "int4") else 0)
    with create_pool(lay, num_blocks=8, sink_fraction=0.25) as pool:
        ids = pool.alloc(3, sinks=1)  # a sequence's first block from the sink region
        k, v = make_kv(3, torch.float32)
        pool.write(ids, k, v)  # any float dtype in: converted (or quantized)
        got_k, got_v = pool.read(ids)
        if dtype in TORCH:
            assert got_k.dtype == TORCH[dtype]
            assert torch.equal(got_k, k.to(TORCH[dtype])) and torch.equal(got_v, v.to(TORCH[dtype]))
        else:
            assert got_k.dtype == torch.float32  # the model dtype
            bound = 0.05 if dtype == "int8" else 0.6
            assert float((got_k - k).abs().max()) < bound
            assert float((got_v - v).abs().max()) < bound
            assert torch.equal(got_k[:, :2], k[:, :2])  # the sink tokens are exact
        queue: Any = multiprocessing.get_context("spawn").Queue()
        child = multiprocessing.get_context("spawn").Process(
            target=_read_in_child, args=(pool.export().to_dict(), ids, queue))
        child.start()
        other = queue.get(timeout=60)
        child.join(60)
        assert child.exitcode == 0
        assert other == (got_k.float().numpy().tobytes(), got_v.float().numpy().tobytes())


def test_the_sliding_window_is_a_value() -> None:
    lay = KVLayout.from_preset("gemma-3-like")
    window = lay.window
    assert window == SlidingWindow(1024, lay.window_layers, 48)
    assert window.pattern == lay.window_pattern == "5:1"
    assert window.full_layers == lay.full_layers == (5, 11, 17, 23, 29, 35, 41, 47)
    assert window.blocks(16) == lay.window_blocks == 64
    assert KVLayout.from_preset("llama-3-8b").window is None
    with pytest.raises(ValueError, match="window layer 48 is not one of the layers 0-47"):
        SlidingWindow(1024, (0, 48), 48)
