"""Gather pool blocks into engine-layout K/V tensors and scatter them back (torch; CPU or CUDA,
on whichever device the view lives).

    pool view   [num_blocks, layers, 2 (K, V), block_size, kv_heads, head_dim]
    engine K/V  [tokens, kv_heads, head_dim]            one layer      (tokens = n * block_size,
                [layers, tokens, kv_heads, head_dim]    all layers      block order preserved)

How: a (block, layer, K|V) slice of the pool, block_size x kv_heads x head_dim elements, is
contiguous both in the pool and in the engine tensor. Both sides are reinterpreted as 2-d arrays
of such rows ("units"), and one indexed copy moves all rows of K, one more all rows of V: no
Python loop over blocks. Gather is torch.index_select, scatter index_copy_, on either device and
on torch's own threads. Rows are reinterpreted as the widest word that divides them: complex128
(16 bytes) down to uint8. A word is only moved, never computed on, so any dtype goes through
bit-exact (NaN payloads included, tested), and a wide word cuts the elements the element-wise
CPU index_copy_ visits (docs/benchmarks.md has the copies against a memcpy). Rows of 32768 or
more elements are split in equal parts, because ATen's CPU index_select copies rows below that
size (its GRAIN_SIZE) with parallel memcpy, and larger rows one by one through a slower path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvpool.errors import InvalidArgument, as_index

if TYPE_CHECKING:
    import torch

_GRAIN = 32768  # at::internal::GRAIN_SIZE


def _geometry(view: torch.Tensor) -> tuple[int, int, int, int, int]:
    if view.dim() != 6 or view.shape[2] != 2:
        raise InvalidArgument(
            "gather/scatter need the 6-d pool view [num_blocks, layers, 2, block_size, kv_heads, "
            f"head_dim], got shape {tuple(view.shape)}; quantized pools (uint8 [num_blocks, "
            "bytes_per_block]) are copied as whole blocks: view()[ids]"
        )
    if not view.is_contiguous():
        raise InvalidArgument("the pool view must be contiguous (use pool.view() as it comes)")
    n_blocks, layers, _, block_size, heads, head_dim = view.shape
    return n_blocks, layers, block_size, heads, head_dim


def _block_ids(
    block_ids: Sequence[int] | torch.Tensor,
    num_blocks: int,
    device: torch.device,
    check: bool,
    distinct: bool,
) -> torch.Tensor:
    import torch

    if isinstance(block_ids, torch.Tensor):
        if block_ids.dim() != 1 or block_ids.dtype.is_floating_point or block_ids.is_complex():
            raise InvalidArgument(
                f"block ids must be a 1-d integer tensor, got {block_ids.dtype} "
                f"{tuple(block_ids.shape)}"
            )
        ids = block_ids.to(device=device, dtype=torch.int64)
        if check and ids.numel():
            lo, hi = int(ids.min()), int(ids.max())  # synchronizes on cuda; check=False skips
            if lo < 0 or hi >= num_blocks:
                bad = lo if lo < 0 else hi
                raise InvalidArgument(f"block id {bad} out of range 0..{num_blocks - 1}")
            if distinct and torch.unique(ids).numel() != ids.numel():
                raise InvalidArgument("scatter got a block id twice")
        return ids
    values = list(block_ids)
    if not all(type(i) is int for i in values):  # numpy integers and the like, one by one
        values = [as_index(i, "block id") for i in values]
    if check and values:
        lo, hi = min(values), max(values)  # C loops: a request's ~100 ids in a few us
        if lo < 0 or hi >= num_blocks:
            bad = lo if lo < 0 else hi
            raise InvalidArgument(f"block id {bad} out of range 0..{num_blocks - 1}")
        if distinct and len(set(values)) != len(values):
            raise InvalidArgument("scatter got a block id twice")
    return torch.tensor(values, dtype=torch.int64, device=device)


def _word(chunk_bytes: int, *tensors: torch.Tensor) -> tuple[torch.dtype, int]:
    """The widest word type dividing the row and every tensor's byte offset."""
    import torch

    for dtype in (torch.complex128, torch.int64, torch.int32, torch.int16, torch.uint8):
        size = dtype.itemsize
        if chunk_bytes % size == 0 and all(
            (t.storage_offset() * t.element_size()) % size == 0 for t in tensors
        ):
            return dtype, size
    raise AssertionError("uint8 divides everything")


def _split(elements: int) -> int:
    """Fewest equal parts that bring a row under _GRAIN elements (1 if none is close)."""
    need = -(-elements // (_GRAIN - 1))
    for parts in range(need, 4 * need + 1):
        if elements % parts == 0:
            return parts
    return 1


def _units(t: torch.Tensor, word: torch.dtype, row_elements: int) -> torch.Tensor:
    """`t` (contiguous) as 2-d [rows, row_elements] of `word`, zero-copy."""
    import torch

    if (t.shape[-1] * t.element_size()) % word.itemsize == 0:
        return t.view(word).view(-1, row_elements)
    return t.reshape(-1).view(torch.uint8).view(word).view(-1, row_elements)


_OFFSETS: dict[tuple[int, int | None, int, str], torch.Tensor] = {}


def _rows(ids: torch.Tensor, layers: int, layer: int | None, parts: int) -> torch.Tensor:
    """Unit rows of K, in engine order: (layer, block, part) or (block, part); V is K + parts.
    Pool row of (block b, layer l, kv, part s) = ((b * layers + l) * 2 + kv) * parts + s.
    The per-(layer, part) offsets are cached per geometry and device."""
    import torch

    key = (layers, layer, parts, str(ids.device))
    offsets = _OFFSETS.get(key)
    if offsets is None:
        sub = torch.arange(parts, device=ids.device)
        if layer is not None:
            offsets = (sub + layer * 2 * parts)[None, :]  # [1, parts]
        else:
            per_layer = torch.arange(layers, device=ids.device) * (2 * parts)
            offsets = per_layer[:, None, None] + sub  # [layers, 1, parts]
        if len(_OFFSETS) >= 256:
            _OFFSETS.clear()
        _OFFSETS[key] = offsets
    # [n, 1] + [1, parts] -> [n, parts];  [n, 1] + [layers, 1, parts] -> [layers, n, parts]
    return (ids * (2 * layers * parts))[:, None].add(offsets).reshape(-1)


def _layer(layer: int | None, layers: int) -> int | None:
    if layer is None:
        return None
    i = as_index(layer, "layer")
    if not 0 <= i < layers:
        raise InvalidArgument(f"layer {i} out of range 0..{layers - 1}")
    return i


def _check_tensor(name: str, t: Any, view: torch.Tensor, shape: tuple[int, ...]) -> None:
    import torch

    if not isinstance(t, torch.Tensor):
        raise InvalidArgument(f"{name} must be a torch tensor, got {type(t).__name__}")
    if t.dtype != view.dtype or t.device != view.device:
        raise InvalidArgument(
            f"{name} is {t.dtype} on {t.device}, the pool is {view.dtype} on {view.device}"
        )
    if tuple(t.shape) != shape:
        raise InvalidArgument(f"{name} has shape {tuple(t.shape)}, expected {shape}")


def _plan(view: torch.Tensor, ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          layer: int | None) -> tuple[torch.Tensor, ...]:
    """The pool, k and v as unit rows of one word type, and the pool rows of K and of V."""
    _, layers, block_size, heads, head_dim = _geometry(view)
    chunk_bytes = block_size * heads * head_dim * view.element_size()
    word, size = _word(chunk_bytes, view, k, v)
    parts = _split(chunk_bytes // size)
    row = chunk_bytes // size // parts
    k_rows = _rows(ids, layers, layer, parts)
    return (_units(view, word, row), _units(k, word, row), _units(v, word, row), k_rows,
            k_rows + parts)


def gather(
    view: torch.Tensor,
    block_ids: Sequence[int] | torch.Tensor,
    layer: int | None = None,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy blocks `block_ids` of the pool `view` into (k, v): [tokens, kv_heads, head_dim] for
    `layer`, or [layers, tokens, kv_heads, head_dim] for all layers; tokens = len(block_ids) *
    block_size in block order. `out=(k, v)`: contiguous tensors of that shape to fill instead of
    allocating. Reads the pool, writes only k and v. `check=False` skips the id range check
    (which synchronizes on cuda when ids are a tensor)."""
    import torch

    _, layers, block_size, heads, head_dim = _geometry(view)
    layer = _layer(layer, layers)
    ids = _block_ids(block_ids, view.shape[0], view.device, check, distinct=False)
    tokens = ids.numel() * block_size
    shape = (tokens, heads, head_dim) if layer is not None else (layers, tokens, heads, head_dim)
    if out is None:
        k = torch.empty(shape, dtype=view.dtype, device=view.device)
        v = torch.empty(shape, dtype=view.dtype, device=view.device)
    else:
        k, v = out
        for name, t in (("out k", k), ("out v", v)):
            _check_tensor(name, t, view, shape)
            if not t.is_contiguous():
                raise InvalidArgument(f"{name} must be contiguous")
    if tokens == 0:
        return k, v
    pool_units, k_units, v_units, k_rows, v_rows = _plan(view, ids, k, v, layer)
    torch.index_select(pool_units, 0, k_rows, out=k_units)
    torch.index_select(pool_units, 0, v_rows, out=v_units)
    return k, v


def scatter(
    view: torch.Tensor,
    block_ids: Sequence[int] | torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int | None = None,
    *,
    check: bool = True,
) -> None:
    """Copy engine-layout `k`, `v` (shapes as `gather` returns them, the pool's dtype and
    device) into blocks `block_ids` of the pool `view`, for `layer` or all layers. Writes only
    those blocks' slices; ids must be distinct. On cuda the copy is queued on the current
    stream: synchronize before telling another process the blocks are written."""
    _, layers, block_size, heads, head_dim = _geometry(view)
    layer = _layer(layer, layers)
    ids = _block_ids(block_ids, view.shape[0], view.device, check, distinct=True)
    tokens = ids.numel() * block_size
    shape = (tokens, heads, head_dim) if layer is not None else (layers, tokens, heads, head_dim)
    _check_tensor("k", k, view, shape)
    _check_tensor("v", v, view, shape)
    if tokens == 0:
        return
    k, v = k.contiguous(), v.contiguous()
    pool_units, k_units, v_units, k_rows, v_rows = _plan(view, ids, k, v, layer)
    pool_units.index_copy_(0, k_rows, k_units)
    pool_units.index_copy_(0, v_rows, v_units)
