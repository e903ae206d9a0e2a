"""gather/scatter between the pool view and engine-layout K/V tensors: bit-exact round trips
against a naive per-block reference, for several geometries and dtypes, one layer and all."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

import pytest
import torch

from kvpool import create_pool, gather, scatter
from kvpool.copy import _split
from kvpool.layout import KVLayout
from radixkv.protocol.errors import InvalidArgument

PREFIX = f"rkvc{os.getpid()}"
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
          "fp8": torch.float8_e4m3fn}

# (layers, kv_heads, head_dim, block_size): odd sizes (rows of 6 bytes: int16 words), GQA-ish
# shapes, and a row of 256 KiB (split in parts below ATen's grain size).
GEOMETRIES = [(1, 1, 3, 1), (3, 2, 8, 4), (2, 4, 64, 16), (1, 8, 128, 64)]


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns (NaNs included): equality below compares bytes, not values."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def naive_gather(view: torch.Tensor, ids: list[int], layer: int | None) -> tuple[torch.Tensor, ...]:
    """Per block, per layer: the reference."""
    out = []
    for kv in (0, 1):
        if layer is None:
            per_layer = [torch.cat([view[b, li, kv] for b in ids]) for li in range(view.shape[1])]
            out.append(torch.stack(per_layer))
        else:
            out.append(torch.cat([view[b, layer, kv] for b in ids]))
    return tuple(out)


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def pool_view(request: pytest.FixtureRequest, gen: torch.Generator) -> Iterator[torch.Tensor]:
    """A real host pool of 6 blocks, filled with random bits."""
    (layers, heads, head_dim, block_size), dtype = request.param
    layout = KVLayout(layers, heads, head_dim, dtype, block_size)
    with create_pool(layout, num_blocks=6, name_prefix=PREFIX) as pool:
        view = pool.view()
        view.copy_(random_bits(tuple(view.shape), view.dtype, gen))
        yield view
        del view


CASES = [(g, d) for g in GEOMETRIES for d in ("fp32", "fp16", "bf16")] + [(GEOMETRIES[1], "fp8")]


@pytest.mark.parametrize("pool_view", CASES, indirect=True, ids=str)
@pytest.mark.parametrize("layer", [None, 0, -1])
def test_gather_matches_naive(pool_view: torch.Tensor, layer: int | None) -> None:
    layers = pool_view.shape[1]
    layer = None if layer is None else layer % layers
    ids = [4, 0, 5, 0]  # order kept, repeats allowed when reading
    k, v = gather(pool_view, ids, layer)
    ref_k, ref_v = naive_gather(pool_view, ids, layer)
    assert k.is_contiguous() and v.is_contiguous()
    assert same_bits(k, ref_k) and same_bits(v, ref_v)
    tokens = len(ids) * pool_view.shape[3]
    tail = tuple(pool_view.shape[4:])
    assert tuple(k.shape) == ((tokens, *tail) if layer is not None else (layers, tokens, *tail))


@pytest.mark.parametrize("pool_view", CASES, indirect=True, ids=str)
@pytest.mark.parametrize("layer", [None, 1])
def test_scatter_then_gather_round_trips(
    pool_view: torch.Tensor, layer: int | None, gen: torch.Generator
) -> None:
    layers = pool_view.shape[1]
    layer = None if layer is None else layer % layers
    ids = [3, 1, 5]
    bs, tail = pool_view.shape[3], tuple(pool_view.shape[4:])
    shape = (len(ids) * bs, *tail) if layer is not None else (layers, len(ids) * bs, *tail)
    k, v = random_bits(shape, pool_view.dtype, gen), random_bits(shape, pool_view.dtype, gen)
    expected = pool_view.clone()
    for j, b in enumerate(ids):  # naive scatter
        for li in ([layer] if layer is not None else range(layers)):
            src_k = k[j * bs:(j + 1) * bs] if layer is not None else k[li, j * bs:(j + 1) * bs]
            src_v = v[j * bs:(j + 1) * bs] if layer is not None else v[li, j * bs:(j + 1) * bs]
            expected[b, li, 0] = src_k
            expected[b, li, 1] = src_v
    scatter(pool_view, ids, k, v, layer)
    assert same_bits(pool_view, expected)  # those slices written, nothing else
    back_k, back_v = gather(pool_view, ids, layer)
    assert same_bits(back_k, k) and same_bits(back_v, v)


def test_out_tensors_and_tensor_ids(gen: torch.Generator) -> None:
    view = random_bits((5, 2, 2, 4, 2, 8), torch.float16, gen)
    ids = torch.tensor([2, 4], dtype=torch.int32)
    k_out, v_out = torch.empty(2, 8, 2, 8, dtype=torch.float16), torch.empty(
        2, 8, 2, 8, dtype=torch.float16
    )
    k, v = gather(view, ids, out=(k_out, v_out))
    assert k is k_out and v is v_out
    ref_k, ref_v = naive_gather(view, [2, 4], None)
    assert same_bits(k, ref_k) and same_bits(v, ref_v)
    # non-contiguous inputs to scatter are fine; empty id lists are no-ops
    scatter(view, [0, 1], k.transpose(0, 1).contiguous().transpose(0, 1), v)
    assert same_bits(view[0], view[2]) and same_bits(view[1], view[4])
    empty_k, _ = gather(view, [], layer=1)
    assert tuple(empty_k.shape) == (0, 2, 8)
    scatter(view, [], empty_k, empty_k, layer=1)


def test_nan_payloads_in_the_16_byte_words_move_unchanged() -> None:
    """Rows move as complex128 words: signalling / quiet NaN doubles with payloads, infinities
    and negative zero must come through bit for bit (they are moved, never computed on)."""
    patterns = torch.tensor([0x7FF0000000000001, 0x7FF4000000000000, -0x0008000000000001,
                             0x7FF8DEADBEEF0001, 0x7FF0000000000000, -0x8000000000000000],
                            dtype=torch.int64)
    view = torch.zeros(4, 1, 2, 2, 2, 6, dtype=torch.float32)  # rows of 96 bytes: 16-byte words
    k = patterns.repeat(4).view(torch.float32).view(1, 4, 2, 6)
    v = patterns.flip(0).repeat(4).view(torch.float32).view(1, 4, 2, 6)
    scatter(view, [3, 1], k, v)
    back_k, back_v = gather(view, [3, 1])
    assert same_bits(back_k, k) and same_bits(back_v, v)


def test_split_keeps_rows_under_the_grain() -> None:
    assert _split(1024) == 1
    assert _split(32768) == 2  # 256 KiB of int64
    assert _split(3 * 32768) == 4  # 3 parts would be exactly 32768: not below


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda w, kv: gather(w, [5]), "block id 5 out of range 0..4"),
        (lambda w, kv: gather(w, torch.tensor([-1])), "block id -1 out of range 0..4"),
        (lambda w, kv: gather(w, [0], layer=2), "layer 2 out of range 0..1"),
        (lambda w, kv: gather(w[0], [0]), "gather/scatter need the 6-d pool view"),
        (lambda w, kv: gather(w, torch.tensor([[0]])), "block ids must be a 1-d integer tensor"),
        (lambda w, kv: gather(w, [0.5]), "block id must be an integer, got 0.5"),
        (
            lambda w, kv: gather(w, [0, 1], out=kv),
            "out k has shape (2, 4, 2, 8), expected (2, 8, 2, 8)",
        ),
        (lambda w, kv: scatter(w, [0, 0], kv[0], kv[1]), "scatter got a block id twice"),
        (
            lambda w, kv: scatter(w, [0], kv[0].float(), kv[1]),
            "k is torch.float32 on cpu, the pool is torch.float16 on cpu",
        ),
        (
            lambda w, kv: scatter(w, [0, 1, 2], kv[0], kv[1]),
            "k has shape (2, 4, 2, 8), expected (2, 12, 2, 8)",
        ),
    ],
)
def test_errors(call: object, message: str) -> None:
    view = torch.zeros(5, 2, 2, 4, 2, 8, dtype=torch.float16)
    kv = (torch.zeros(2, 4, 2, 8, dtype=torch.float16),) * 2
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        call(view, kv)  # type: ignore[operator]


def test_quantized_pools_are_refused() -> None:
    with create_pool(KVLayout(2, 2, 8, "int8", 4), num_blocks=2, name_prefix=PREFIX) as pool:
        view = pool.view()
        with pytest.raises(InvalidArgument, match=r"copied as whole blocks: view\(\)\[ids\]"):
            gather(view, [0])
        del view
