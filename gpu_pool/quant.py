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
/ (max - min) x 15), two values a byte (element 2i in the low nibble, 2i+1 in the high one).

A *sink block* (ids from the pool's sink region, which the service gives the block at position 0
of every sequence) is a quantized block followed by a `sink` segment: its first `sink_tokens`
tokens [layers, 2, sink_tokens, kv_heads, head_dim] in the model dtype, bit-exact. Those tokens
are zero in the quantized part, so they do not widen the per-channel key ranges.

`gather` reads whole block rows with one index_select per region, then dequantizes all blocks in
one batch of tensor ops; `scatter` quantizes in one batch and writes rows with one index_copy_
per region. Nothing loops over blocks in Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from gpu_pool.errors import InvalidArgument
from gpu_pool.layout import KVLayout

if TYPE_CHECKING:
    import torch

TORCH_MODEL_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def model_dtype(layout: KVLayout) -> torch.dtype:
    import torch

    return getattr(torch, TORCH_MODEL_DTYPES[layout.model_dtype])  # type: ignore[no-any-return]


# ---- the math on [n, layers, 2, block_size, kv_heads, head_dim] float tensors ---------------

def _groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """[..., head_dim] -> [..., head_dim / group, group] (a view)."""
    return x.reshape(*x.shape[:-1], -1, group)


def _absmax_int8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (int8 codes [..., head_dim], fp16 scales [..., head_dim / group])."""
    import torch

    g = _groups(x, group)
    scale = (g.abs().amax(-1) / 127).to(torch.float16)
    s = scale.float()
    q = torch.round(g / torch.where(s > 0, s, 1).unsqueeze(-1)).clamp_(-127, 127)
    return q.to(torch.int8).flatten(-2), scale


def _minmax_int4(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit codes of x over `dim` (the reduced axis): (codes 0..15 as uint8,
    fp16 scale, fp16 zero), scale and zero with `dim` reduced."""
    import torch

    lo = x.amin(dim, keepdim=True)
    hi = x.amax(dim, keepdim=True)
    zero = lo.to(torch.float16)
    scale = ((hi - zero.float()) / 15).to(torch.float16)
    s = scale.float()
    q = torch.round((x - zero.float()) / torch.where(s > 0, s, 1)).clamp_(0, 15)
    return q.to(torch.uint8), scale.squeeze(dim), zero.squeeze(dim)


def _pack4(q: torch.Tensor) -> torch.Tensor:
    return q[..., 0::2] | (q[..., 1::2] << 4)


def _unpack4(p: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.stack((p & 15, p >> 4), -1).flatten(-2)


def encode(layout: KVLayout, kv: torch.Tensor) -> dict[str, torch.Tensor]:
    """kv [n, layers, 2, block_size, kv_heads, head_dim] (float) -> segments, each with a
    leading n dimension, shaped as `layout.segments()` says."""
    import torch

    x = kv.float()
    group = layout.group
    k, v = x[:, :, 0], x[:, :, 1]  # [n, L, B, H, D]
    if layout.dtype == "int8":
        qk, k_scale = _absmax_int8(k, group)
        qv, v_scale = _absmax_int8(v, group)
        data = torch.stack((qk, qv), 2).view(torch.uint8)
        return {"data": data, "k_scale": k_scale, "v_scale": v_scale}
    if layout.key_scales == "channel":  # over the block's tokens: [n, L, H, D]
        qk, k_scale, k_zero = _minmax_int4(k, dim=2)
    else:
        qk, k_scale, k_zero = _minmax_int4(_groups(k, group), dim=-1)
        qk = qk.flatten(-2)
    qv, v_scale, v_zero = _minmax_int4(_groups(v, group), dim=-1)
    data = _pack4(torch.stack((qk, qv.flatten(-2)), 2))
    return {"data": data, "k_scale": k_scale, "k_zero": k_zero,
            "v_scale": v_scale, "v_zero": v_zero}


def decode(layout: KVLayout, seg: dict[str, torch.Tensor], out_dtype: torch.dtype
           ) -> torch.Tensor:
    """Segments (leading n) -> kv [n, layers, 2, block_size, kv_heads, head_dim] in out_dtype."""
    import torch

    group = layout.group
    if layout.dtype == "int8":
        q = _groups(seg["data"].view(torch.int8).float(), group)
        scales = torch.stack((seg["k_scale"], seg["v_scale"]), 2).float().unsqueeze(-1)
        out: torch.Tensor = (q * scales).flatten(-2).to(out_dtype)
        return out
    q = _unpack4(seg["data"]).float()  # [n, L, 2, B, H, D]
    qk, qv = q[:, :, 0], q[:, :, 1]
    if layout.key_scales == "channel":
        k = qk * seg["k_scale"].float().unsqueeze(2) + seg["k_zero"].float().unsqueeze(2)
    else:
        k = (_groups(qk, group) * seg["k_scale"].float().unsqueeze(-1)
             + seg["k_zero"].float().unsqueeze(-1)).flatten(-2)
    v = (_groups(qv, group) * seg["v_scale"].float().unsqueeze(-1)
         + seg["v_zero"].float().unsqueeze(-1)).flatten(-2)
    return torch.stack((k, v), 2).to(out_dtype)


def roundtrip(layout: KVLayout, kv: torch.Tensor, sinks: bool = True) -> torch.Tensor:
    """What the pool gives back for kv [n, layers, 2, block_size, heads, dim] written as
    blocks; with `sinks`, block 0 is a sink block (its first sink_tokens tokens exact)."""
    rows = to_rows(layout, kv, num_sink=1 if sinks and layout.sink_tokens else 0)
    return from_rows(layout, rows, num_sink=1 if sinks and layout.sink_tokens else 0,
                     out_dtype=kv.dtype)


# ---- rows of bytes <-> blocks ----------------------------------------------------------------

def to_rows(layout: KVLayout, kv: torch.Tensor, num_sink: int = 0) -> torch.Tensor:
    """kv [n, ...] -> uint8 rows [n, sink_bytes_per_block] (the first `num_sink` blocks carry
    their sink tokens after the quantized part; other rows leave those bytes zero)."""
    import torch

    if not bool(torch.isfinite(kv).all()):
        raise InvalidArgument("KV holds NaN or Inf: refusing to quantize it into the pool")
    s = layout.sink_tokens if num_sink else 0
    sink_part = kv[:num_sink, :, :, :s].contiguous() if s else None
    if s:
        kv = kv.clone()
        kv[:num_sink, :, :, :s] = 0
    seg = encode(layout, kv)
    n = kv.shape[0]
    parts = [seg[name].contiguous().view(torch.uint8).reshape(n, -1)
             for name, _, _ in layout.segments()]
    width = layout.sink_bytes_per_block if num_sink else layout.bytes_per_block
    rows = torch.zeros((n, width), dtype=torch.uint8, device=kv.device)
    rows[:, :layout.bytes_per_block] = torch.cat(parts, 1)
    if sink_part is not None:
        rows[:num_sink, layout.bytes_per_block:] = (
            sink_part.to(model_dtype(layout)).view(torch.uint8).reshape(num_sink, -1))
    return rows


def from_rows(layout: KVLayout, rows: torch.Tensor, num_sink: int = 0,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """uint8 rows [n, >= bytes_per_block] -> kv [n, layers, 2, block_size, heads, dim]; the
    first `num_sink` rows are sink blocks."""
    import torch

    n = rows.shape[0]
    seg = {}
    offset = 0
    for name, shape, itemsize in layout.segments():
        size = itemsize
        for d in shape:
            size *= d
        part = rows[:, offset:offset + size].contiguous()
        dtype = torch.float16 if itemsize == 2 else torch.uint8
        seg[name] = part.view(dtype).reshape(n, *shape)
        offset += size
    out_dtype = out_dtype or model_dtype(layout)
    kv = decode(layout, seg, out_dtype)
    s = layout.sink_tokens
    if num_sink and s:
        exact = rows[:num_sink, layout.bytes_per_block:].contiguous().view(model_dtype(layout))
        kv[:num_sink, :, :, :s] = exact.reshape(
            num_sink, layout.num_layers, 2, s, layout.num_kv_heads, layout.head_dim
        ).to(out_dtype)
    return kv


# ---- gather / scatter against a pool ------------------------------------------------------

def _split_ids(ids: Sequence[int], num_blocks: int, num_sink: int) -> tuple[list[int], list[int]]:
    """Positions of sink ids and of regular ids in `ids` (validated)."""
    sink_pos: list[int] = []
    plain_pos: list[int] = []
    total = num_blocks
    for pos, i in enumerate(ids):
        if not 0 <= i < total:
            raise InvalidArgument(f"block id {i} out of range 0..{total - 1}")
        (sink_pos if i >= num_blocks - num_sink else plain_pos).append(pos)
    return sink_pos, plain_pos


def gather(layout: KVLayout, plain: torch.Tensor, sink: torch.Tensor, block_ids: Sequence[int],
           out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantize blocks `block_ids` of a pool whose regular region is `plain` (uint8 [N,
    bytes_per_block]) and sink region `sink` (uint8 [M, sink_bytes_per_block]; ids N..N+M-1)
    into (k, v), each [layers, tokens, kv_heads, head_dim] in the model dtype."""
    import torch

    ids = [int(i) for i in block_ids]
    n_plain, n_sink = plain.shape[0], sink.shape[0]
    sink_pos, plain_pos = _split_ids(ids, n_plain + n_sink, n_sink)
    out_dtype = out_dtype or model_dtype(layout)
    L, B, H, D = layout.num_layers, layout.block_size, layout.num_kv_heads, layout.head_dim
    kv = torch.empty((len(ids), L, 2, B, H, D), dtype=out_dtype, device=plain.device)
    dev = plain.device
    if plain_pos:
        rows = plain.index_select(0, torch.tensor([ids[p] for p in plain_pos], device=dev))
        kv[torch.tensor(plain_pos, device=dev)] = from_rows(layout, rows, 0, out_dtype)
    if sink_pos:
        rows = sink.index_select(
            0, torch.tensor([ids[p] - n_plain for p in sink_pos], device=dev))
        kv[torch.tensor(sink_pos, device=dev)] = from_rows(layout, rows, len(sink_pos),
                                                           out_dtype)
    # [n, L, 2, B, H, D] -> K, V as [L, n * B, H, D]
    k = kv[:, :, 0].transpose(0, 1).reshape(L, -1, H, D)
    v = kv[:, :, 1].transpose(0, 1).reshape(L, -1, H, D)
    return k, v


def scatter(layout: KVLayout, plain: torch.Tensor, sink: torch.Tensor, block_ids: Sequence[int],
            k: torch.Tensor, v: torch.Tensor) -> None:
    """Quantize k, v ([layers, tokens, kv_heads, head_dim], tokens = len(block_ids) x
    block_size) into blocks `block_ids` (distinct). Refuses NaN/Inf before writing anything."""
    import torch

    ids = [int(i) for i in block_ids]
    if len(set(ids)) != len(ids):
        raise InvalidArgument("scatter got a block id twice")
    L, B, H, D = layout.num_layers, layout.block_size, layout.num_kv_heads, layout.head_dim
    shape = (L, len(ids) * B, H, D)
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != shape:
            raise InvalidArgument(f"{name} has shape {tuple(t.shape)}, expected {shape}")
    n_plain, n_sink = plain.shape[0], sink.shape[0]
    sink_pos, plain_pos = _split_ids(ids, n_plain + n_sink, n_sink)
    dev = plain.device
    kv = torch.stack((k.to(dev), v.to(dev)), 1)  # [L, 2, n * B, H, D]
    kv = kv.reshape(L, 2, len(ids), B, H, D).permute(2, 0, 1, 3, 4, 5)  # [n, L, 2, B, H, D]
    if not bool(torch.isfinite(kv).all()):
        raise InvalidArgument("KV holds NaN or Inf: refusing to quantize it into the pool")
    if plain_pos:
        rows = to_rows(layout, kv[torch.tensor(plain_pos, device=dev)], 0)
        plain.index_copy_(0, torch.tensor([ids[p] for p in plain_pos], device=dev), rows)
    if sink_pos:
        rows = to_rows(layout, kv[torch.tensor(sink_pos, device=dev)], len(sink_pos))
        sink.index_copy_(0, torch.tensor([ids[p] - n_plain for p in sink_pos], device=dev),
                         rows)
