"""Quantized KV blocks: the codec (torch ops, the same code on CPU and CUDA).

A quantized block is a row of `layout.bytes_per_block` bytes, cut into segments
(`KVLayout.segments()`), each a C-contiguous array:

    data     [layers, 2 (K, V), block_size, kv_heads, head_dim x bits / 8]    int8 or packed int4
    k_scale  int8 / int4 per-token: [layers, block_size, kv_heads, head_dim / group]   fp16
             int4 per-channel:      [layers, kv_heads, head_dim]  (over the block's tokens)
    k_zero   int4 only, shaped as k_scale (the group's minimum: asymmetric, 16 levels)
    v_scale  [layers, block_size, kv_heads, head_dim / group]                           fp16
    v_zero   int4 only, shaped as v_scale

int8 is symmetric absmax: q = round(x / max|x| x 127). int4 is asymmetric: q = round((x - min)
/ (max - min) x 15), two values a byte: channel i in the low nibble, channel i + head_dim / 2 in
the high one (halves, not neighbours: unpacking then writes two contiguous runs, which torch's
CPU kernels do much faster than every-other-element ones).

A *sink block* (the block at position 0 of every sequence) is a quantized block followed by a
`sink` segment: its first `sink_tokens` tokens [layers, 2, sink_tokens, kv_heads, head_dim] in
the model dtype, bit-exact (zero in the quantized part, so they widen no key range). The fused
CPU kernel (quant_kernel.cpp; these ops are its reference and the path everywhere else), zeros
stored as +0, and the values fp16 scales cannot hold (refused): docs/quantization.md.
"""

from __future__ import annotations

import array
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvpool import quant_kernel
from kvpool.errors import InvalidArgument
from kvpool.layout import KVLayout

if TYPE_CHECKING:
    import torch

TORCH_MODEL_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def model_dtype(layout: KVLayout) -> torch.dtype:
    import torch

    return getattr(torch, TORCH_MODEL_DTYPES[layout.model_dtype])  # type: ignore[no-any-return]


# ---- a block row's segments as views ---------------------------------------------------------

def segment_views(layout: KVLayout, rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """Zero-copy views of uint8 rows [n, >= bytes_per_block] as the layout's segments, each
    [n, *shape] (data as int8 for int8 layouts, uint8 packed nibbles for int4; scales fp16)."""
    import torch

    n = rows.shape[0]
    out = {}
    offset = 0
    for name, shape, itemsize in layout.segments():
        size = itemsize * math.prod(shape)
        part = rows[:, offset:offset + size]
        if itemsize == 2:
            part = part.view(torch.float16)
        elif layout.dtype == "int8":
            part = part.view(torch.int8)
        out[name] = part.reshape(n, *shape) if part.is_contiguous() else part.view(n, *shape)
        offset += size
    return out


def _groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """[..., head_dim] -> [..., head_dim / group, group] (a view)."""
    return x.view(*x.shape[:-1], -1, group)


def _per_block(t: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """[layers, n * block_size, heads, dim] -> [layers, n, block_size, heads, dim] (a view)."""
    return t.view(t.shape[0], -1, layout.block_size, t.shape[2], t.shape[3])


def _to_blocks(t: torch.Tensor) -> torch.Tensor:
    """A [n, layers, ...] segment as [layers, n, ...] (a view), the engine's order."""
    return t.transpose(0, 1)


# ---- dequantize: segments -> engine-layout K, V (one fused op per part) -------------------

CHUNK_ELEMENTS = 1 << 18  # per step: temporaries stay in cache (fresh large ones page-fault)


def _chunks(layout: KVLayout, n: int) -> list[tuple[slice, slice]]:
    """(layers, blocks) slices covering [layers, n] in steps of about CHUNK_ELEMENTS."""
    per_block = layout.block_size * layout.num_kv_heads * layout.head_dim
    step = max(1, CHUNK_ELEMENTS // per_block)
    return [(slice(layer, layer + 1), slice(b, b + step))
            for layer in range(layout.num_layers) for b in range(0, n, step)]


def decode_into(layout: KVLayout, seg: dict[str, torch.Tensor], k_out: torch.Tensor,
                v_out: torch.Tensor) -> None:
    """Dequantize segments ([n, layers, ...] views) into k_out, v_out: [layers, n, block_size,
    heads, head_dim] tensors of the output dtype (views of the engine's [layers, tokens, ...]),
    a cache-sized chunk at a time."""
    for layers, blocks in _chunks(layout, k_out.shape[1]):
        part = {name: _to_blocks(t[blocks, layers]) for name, t in seg.items()}
        data = part["data"]  # [L, n, 2, B, H, D or D/2]
        for i, out in ((0, k_out[layers, blocks]), (1, v_out[layers, blocks])):
            name = "k" if i == 0 else "v"
            q = data[:, :, i]
            out.copy_(_dequantize(
                q if layout.dtype == "int4" else q.contiguous(), part[f"{name}_scale"],
                part.get(f"{name}_zero"), layout.dtype == "int8", layout.group,
                name == "k" and layout.key_scales == "channel", out.dtype))


def _dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, int8: bool,
                group: int, channel: bool, dtype: torch.dtype) -> torch.Tensor:
    """Codes [..., B, H, D (int8) or D/2 (int4)] and their scales -> values [..., B, H, D].
    Arithmetic in fp32: mixed-dtype torch ops (int8 x fp16) take a slow casting path on CPU."""
    import torch

    if int8:  # q x scale, per (token, head, group)
        x = q.float()
        return _groups(x, group).mul_(scale.float().unsqueeze(-1)).flatten(-2).to(dtype)
    assert zero is not None
    x = torch.cat((q & 15, q >> 4), -1).float()  # halves: contiguous runs
    if channel:  # scales [..., H, D] over the block's tokens
        x.mul_(scale.float().unsqueeze(-3)).add_(zero.float().unsqueeze(-3))
    else:
        _groups(x, group).mul_(scale.float().unsqueeze(-1)).add_(zero.float().unsqueeze(-1))
    return x.to(dtype)


# ---- quantize: engine-layout K, V -> segments ---------------------------------------------

NON_FINITE = "KV holds NaN or Inf: refusing to quantize it into the pool"
BEYOND_FP16 = ("KV values beyond what a quantized block's fp16 scales hold (int8: |x| up to "
               "about 8.3e6; int4: a minimum within +-65504 and a group's or channel's range up "
               "to about 9.8e5): refusing to quantize them into the pool (they would read back "
               "as NaN or Inf)")


def _refuse_non_finite(extreme: torch.Tensor) -> None:
    """NaN and Inf reach a group's max or min (amax/amin propagate NaN): checking those small
    tensors checks every element."""
    import torch

    if not bool(torch.isfinite(extreme).all()):
        raise InvalidArgument(NON_FINITE)


def _refuse_beyond_fp16(scale: torch.Tensor, zero: torch.Tensor) -> None:
    """Finite K/V whose fp16 scale or minimum overflowed (to Inf) cannot be stored."""
    import torch

    if not bool(torch.isfinite(scale).all() and torch.isfinite(zero).all()):
        raise InvalidArgument(BEYOND_FP16)


def _quantize(x: torch.Tensor, int8: bool, group: int, channel: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values [..., B, H, D] -> (codes: int8 [..., D] or packed uint8 [..., D/2], fp16 scale,
    fp16 zero (int4; int8 returns its scale again), the fp32 extremes to check for NaN/Inf)."""
    import torch

    xf = x.to(torch.float32, copy=True)  # one fp32 copy, then in place
    if int8:  # symmetric absmax per (token, head, group)
        xg = _groups(xf, group)
        amax = torch.maximum(xg.amax(-1), xg.amin(-1).neg()).add_(0.0)  # -0 -> +0
        scale = (amax / 127).to(torch.float16)
        inv = scale.float().clamp_min(1e-30).reciprocal()  # a zero row stays zero
        xg.mul_(inv.unsqueeze(-1)).round_().clamp_(-127, 127)
        return xf.to(torch.int8), scale, scale, amax
    if channel:  # keys: per channel over the block's tokens
        lo32, hi = xf.amin(-3, keepdim=True), xf.amax(-3, keepdim=True)
        view = xf
    else:
        view = _groups(xf, group)
        lo32, hi = view.amin(-1, keepdim=True), view.amax(-1, keepdim=True)
    lo = (lo32 + 0.0).to(torch.float16)  # (+ 0.0: -0 -> +0)
    scale = ((hi - lo.float()) / 15).add_(0.0).to(torch.float16)
    inv = scale.float().clamp_min(1e-30).reciprocal()
    view.sub_(lo.float()).mul_(inv).round_().clamp_(0, 15)
    codes = xf.to(torch.int8)  # (float -> int8 is the fast cast)
    half = codes.shape[-1] // 2
    packed = (codes[..., :half] | (codes[..., half:] << 4)).view(torch.uint8)
    squeeze = -3 if channel else -1
    return (packed, scale.squeeze(squeeze), lo.squeeze(squeeze),
            torch.cat((lo32.flatten(), hi.flatten())))


def encode_from(layout: KVLayout, k: torch.Tensor, v: torch.Tensor,
                seg: dict[str, torch.Tensor]) -> None:
    """Quantize k, v ([layers, n, block_size, heads, head_dim], any float dtype) into the
    segments' views ([n, layers, ...]), a cache-sized chunk at a time. InvalidArgument on NaN
    or Inf, or on values whose fp16 scale or minimum would overflow (what was written so far
    stays in `seg`)."""
    for layers, blocks in _chunks(layout, k.shape[1]):
        part = {name: _to_blocks(t[blocks, layers]) for name, t in seg.items()}
        for i, x in ((0, k[layers, blocks]), (1, v[layers, blocks])):
            name = "k" if i == 0 else "v"
            codes, scale, zero, extremes = _quantize(
                x, layout.dtype == "int8", layout.group,
                name == "k" and layout.key_scales == "channel")
            _refuse_non_finite(extremes)
            _refuse_beyond_fp16(scale, zero)
            part["data"][:, :, i].copy_(codes)
            part[f"{name}_scale"].copy_(scale)
            if layout.dtype == "int4":
                part[f"{name}_zero"].copy_(zero)


# ---- rows of bytes <-> blocks (tests, tools) -----------------------------------------------

def to_rows(layout: KVLayout, kv: torch.Tensor, num_sink: int = 0) -> torch.Tensor:
    """kv [n, layers, 2, block_size, heads, dim] -> uint8 rows [n, bytes_per_block] (or
    [n, sink_bytes_per_block] with the first `num_sink` blocks carrying their sink tokens)."""
    import torch

    n = kv.shape[0]
    width = layout.sink_bytes_per_block if num_sink else layout.bytes_per_block
    rows = torch.zeros((n, width), dtype=torch.uint8, device=kv.device)
    _encode_rows(layout, kv[:, :, 0].transpose(0, 1), kv[:, :, 1].transpose(0, 1), rows,
                 num_sink)
    return rows


def from_rows(layout: KVLayout, rows: torch.Tensor, num_sink: int = 0,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """uint8 rows -> kv [n, layers, 2, block_size, heads, dim]; the first `num_sink` rows are
    sink blocks."""
    import torch

    L, B, H, D = layout.num_layers, layout.block_size, layout.num_kv_heads, layout.head_dim
    n = rows.shape[0]
    k = torch.empty((L, n, B, H, D), dtype=out_dtype or model_dtype(layout), device=rows.device)
    v = torch.empty_like(k)
    _decode_rows(layout, rows, num_sink, k, v)
    return torch.stack((k, v), 2).transpose(0, 1)


def roundtrip(layout: KVLayout, kv: torch.Tensor, sinks: bool = True) -> torch.Tensor:
    """What the pool gives back for kv [n, layers, 2, block_size, heads, dim] written as
    blocks; with `sinks`, block 0 is a sink block (its first sink_tokens tokens exact)."""
    num_sink = 1 if sinks and layout.sink_tokens else 0
    return from_rows(layout, to_rows(layout, kv, num_sink), num_sink, out_dtype=kv.dtype)


def _encode_rows(layout: KVLayout, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
                 num_sink: int) -> None:
    """k, v [layers, n, B, H, D] into rows [n, width]; rows[:num_sink] are sink blocks: their
    first sink_tokens tokens go to the sink segment exactly and enter the scales as zeros."""
    s = layout.sink_tokens if num_sink else 0
    if s:
        _refuse_non_finite(k[:, :num_sink, :s])
        _refuse_non_finite(v[:, :num_sink, :s])
        sink_seg = rows[:num_sink, layout.bytes_per_block:].view(model_dtype(layout)).view(
            num_sink, layout.num_layers, 2, s, layout.num_kv_heads, layout.head_dim)
        sink_seg[:, :, 0].copy_(k[:, :num_sink, :s].transpose(0, 1))
        sink_seg[:, :, 1].copy_(v[:, :num_sink, :s].transpose(0, 1))
        k, v = k.clone(), v.clone()
        k[:, :num_sink, :s] = 0
        v[:, :num_sink, :s] = 0
    encode_from(layout, k, v, segment_views(layout, rows))


def _decode_rows(layout: KVLayout, rows: torch.Tensor, num_sink: int, k: torch.Tensor,
                 v: torch.Tensor) -> None:
    """rows [n, width] into k, v [layers, n, B, H, D]; rows[:num_sink] are sink blocks."""
    decode_into(layout, segment_views(layout, rows), k, v)
    s = layout.sink_tokens if num_sink else 0
    if s:
        exact = rows[:num_sink, layout.bytes_per_block:].view(model_dtype(layout)).view(
            num_sink, layout.num_layers, 2, s, layout.num_kv_heads, layout.head_dim)
        k[:, :num_sink, :s] = exact[:, :, 0].transpose(0, 1)
        v[:, :num_sink, :s] = exact[:, :, 1].transpose(0, 1)


# ---- gather / scatter against a pool ------------------------------------------------------

def _ids(block_ids: Sequence[int], num_blocks: int) -> tuple[array.array[int], torch.Tensor]:
    """`block_ids` as int64s, checked to lie in 0..num_blocks-1, and as a CPU tensor sharing
    their buffer (keep the array alive while the tensor is used). C loops: Python loops over a
    request's ids would cost a noticeable share of a small gather."""
    import torch

    try:
        ids = array.array("q", block_ids)
    except TypeError:  # floats and other int-likes, as int() takes them
        ids = array.array("q", [int(i) for i in block_ids])
    if not ids:
        return ids, torch.empty(0, dtype=torch.int64)
    t = torch.frombuffer(ids, dtype=torch.int64)
    lo, hi = (int(x) for x in torch.aminmax(t))
    if lo < 0 or hi >= num_blocks:
        raise InvalidArgument(f"block id {lo if lo < 0 else hi} out of range 0..{num_blocks - 1}")
    return ids, t


def _order(ids: Sequence[int], num_blocks: int, num_sink: int) -> tuple[list[int], list[int]]:
    """Positions in `ids` (checked) of sink blocks, then of regular ones."""
    first_sink = num_blocks - num_sink
    sinks: list[int] = []
    regular: list[int] = []
    for pos, i in enumerate(ids):
        (sinks if i >= first_sink else regular).append(pos)
    return sinks, regular


def gather(layout: KVLayout, plain: torch.Tensor, sink: torch.Tensor, block_ids: Sequence[int],
           out_dtype: torch.dtype | None = None, *,
           out: tuple[torch.Tensor, torch.Tensor] | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantize blocks `block_ids` of a pool whose regular region is `plain` (uint8 [N,
    bytes_per_block]) and sink region `sink` (uint8 [M, sink_bytes_per_block]; ids N..N+M-1)
    into (k, v), each [layers, tokens, kv_heads, head_dim] in the model dtype (or
    `out_dtype`). `out=(k, v)`: contiguous tensors of that shape, any float dtype, on the pool's
    device, to fill instead of allocating."""
    import torch

    n_plain = plain.shape[0]
    ids, id_tensor = _ids(block_ids, n_plain + sink.shape[0])
    L, B, H, D = layout.num_layers, layout.block_size, layout.num_kv_heads, layout.head_dim
    dev = plain.device
    shape = (L, len(ids) * B, H, D)
    if out is None:
        k = torch.empty(shape, dtype=out_dtype or model_dtype(layout), device=dev)
        v = torch.empty_like(k)
    else:
        k, v = out
        for name, t in (("out k", k), ("out v", v)):
            if (tuple(t.shape) != shape or t.device != dev or not t.is_contiguous()
                    or not t.dtype.is_floating_point or t.dtype != k.dtype):
                raise InvalidArgument(
                    f"{name} is {t.dtype} {tuple(t.shape)} on {t.device}, expected a "
                    f"contiguous float tensor {shape} on {dev} (k and v of one dtype)")
    kernel = quant_kernel.usable(plain, k.dtype)
    if kernel is not None:
        kernel.decode(plain, sink, id_tensor, k, v, quant_kernel.format_of(layout))
        return k, v
    sink_pos, plain_pos = _order(ids, n_plain + sink.shape[0], sink.shape[0])
    if not sink_pos:  # the common case: one index_select, one fused op per part
        rows = plain.index_select(0, id_tensor.to(dev))
        _decode_rows(layout, rows, 0, _per_block(k, layout), _per_block(v, layout))
        return k, v
    order = sink_pos + plain_pos  # decode sink rows first, then put blocks in place
    rows = torch.empty((len(ids), sink.shape[1]), dtype=torch.uint8, device=dev)
    rows[:len(sink_pos)] = sink.index_select(
        0, torch.tensor([ids[p] - n_plain for p in sink_pos], device=dev))
    if plain_pos:
        rows[len(sink_pos):, :plain.shape[1]] = plain.index_select(
            0, torch.tensor([ids[p] for p in plain_pos], device=dev))
    kb, vb = torch.empty_like(k), torch.empty_like(v)
    _decode_rows(layout, rows, len(sink_pos), _per_block(kb, layout), _per_block(vb, layout))
    where = torch.tensor(order, device=dev)
    _per_block(k, layout).index_copy_(1, where, _per_block(kb, layout))
    _per_block(v, layout).index_copy_(1, where, _per_block(vb, layout))
    return k, v


def scatter(layout: KVLayout, plain: torch.Tensor, sink: torch.Tensor, block_ids: Sequence[int],
            k: torch.Tensor, v: torch.Tensor) -> None:
    """Quantize k, v ([layers, tokens, kv_heads, head_dim], tokens = len(block_ids) x
    block_size) into blocks `block_ids` (distinct). Refuses NaN/Inf, and values beyond what
    fp16 scales hold, before writing anything."""
    import torch

    n_plain = plain.shape[0]
    ids, id_tensor = _ids(block_ids, n_plain + sink.shape[0])
    if len(set(ids)) != len(ids):
        raise InvalidArgument("scatter got a block id twice")
    L, B, H, D = layout.num_layers, layout.block_size, layout.num_kv_heads, layout.head_dim
    shape = (L, len(ids) * B, H, D)
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != shape:
            raise InvalidArgument(f"{name} has shape {tuple(t.shape)}, expected {shape}")
    dev = plain.device
    k, v = k.to(dev).contiguous(), v.to(dev).contiguous()
    kernel = quant_kernel.usable(plain, k.dtype) if k.dtype == v.dtype else None
    if kernel is not None:  # checks every value before it writes any
        refused = kernel.encode(k, v, id_tensor, plain, sink, quant_kernel.format_of(layout))
        if refused:
            raise InvalidArgument(NON_FINITE if refused == quant_kernel.NON_FINITE
                                  else BEYOND_FP16)
        return
    sink_pos, plain_pos = _order(ids, n_plain + sink.shape[0], sink.shape[0])
    kb, vb = _per_block(k, layout), _per_block(v, layout)
    if not sink_pos:
        rows = torch.empty((len(ids), plain.shape[1]), dtype=torch.uint8, device=dev)
        _encode_rows(layout, kb, vb, rows, 0)
        plain.index_copy_(0, id_tensor.to(dev), rows)
        return
    order = torch.tensor(sink_pos + plain_pos, device=dev)
    rows = torch.zeros((len(ids), sink.shape[1]), dtype=torch.uint8, device=dev)
    _encode_rows(layout, kb.index_select(1, order), vb.index_select(1, order), rows,
                 len(sink_pos))
    sink.index_copy_(0, torch.tensor([ids[p] - n_plain for p in sink_pos], device=dev),
                     rows[:len(sink_pos)])
    if plain_pos:
        plain.index_copy_(0, torch.tensor([ids[p] for p in plain_pos], device=dev),
                          rows[len(sink_pos):, :plain.shape[1]])
