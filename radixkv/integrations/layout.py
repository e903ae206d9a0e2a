"""Engine paged-KV layouts <-> radixkv's canonical block layout.

radixkv stores a block as [layers, 2 (K, V), block_size, kv_heads, head_dim] (`pool.view()[id]`),
token-major, so a prefix is the same bytes whichever engine wrote it. Engines keep one tensor per
layer, cut into pages of block_size tokens, with their own page interior:

- `FlashPages`: [2, num_pages, block_size, kv_heads, head_dim] per layer (vLLM's FlashAttention
  layout on GPU): a page is the canonical layout of one layer already.
- `ProbedPages`: [num_pages, kv_heads, block_size, 2 * head_dim] per layer (vLLM's CPU attention).
  Its page interior depends on the kernel's instruction set (measured: fp32 on AVX-512 stores
  keys dim-major and values token-major; bf16 on AMX packs both in VNNI pairs), so it is not
  assumed: `probe` writes known K/V through the engine's own cache-update op into a scratch page
  and reads back where every (K|V, token, head, dim) element landed. The result is one index per
  canonical element; a copy is one gather or scatter per layer, any dtype bit-exact.

Copies take block ids on both sides (engine pages and pool blocks, equal block sizes) and run on
the tensors' device; on CUDA they are queued on the current stream (synchronize before telling
the service the blocks are written or may be reused).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# (K, V, scratch page, slot mapping) -> None: the engine's own cache write for one layer
CacheWrite = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


class LayoutError(ValueError):
    """An engine KV tensor this module cannot map (its message says what was found)."""


def _ids(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(list(ids), dtype=torch.long, device=device)


@dataclass(frozen=True)
class FlashPages:
    """Per layer [2, num_pages, block_size, kv_heads, head_dim]: page p of layer l is
    kv[l][:, p], the canonical [2, block, heads, dim] of that layer."""

    def to_pool(self, layers: Sequence[torch.Tensor], pages: Sequence[int],
                pool_view: torch.Tensor, blocks: Sequence[int]) -> None:
        """Copy engine pages `pages` into pool blocks `blocks` (same order)."""
        if not pages:
            return
        p, b = _ids(pages, layers[0].device), _ids(blocks, pool_view.device)
        for i, kv in enumerate(layers):
            pool_view[b, i] = kv[:, p].transpose(0, 1).to(pool_view.device)

    def from_pool(self, layers: Sequence[torch.Tensor], pages: Sequence[int],
                  pool_view: torch.Tensor, blocks: Sequence[int]) -> None:
        """Copy pool blocks `blocks` into engine pages `pages` (same order)."""
        if not pages:
            return
        p, b = _ids(pages, layers[0].device), _ids(blocks, pool_view.device)
        for i, kv in enumerate(layers):
            kv[:, p] = pool_view[b, i].transpose(0, 1).to(kv.device)


@dataclass(frozen=True)
class ProbedPages:
    """Per layer [num_pages, kv_heads, block_size, 2 * head_dim], each page's interior given by
    `index`: index[c] is the position, in the page's flat kv_heads*block_size*2*head_dim
    elements, of canonical element c of [2, block_size, kv_heads, head_dim]."""

    index: torch.Tensor  # int64 [2 * block_size * kv_heads * head_dim]
    block_size: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def probe(cls, write: CacheWrite, num_kv_heads: int, block_size: int, head_dim: int,
              dtype: torch.dtype) -> ProbedPages:
        """Find the page interior by writing known values through `write` (the engine's cache
        update for one layer) into a one-page scratch tensor. LayoutError if the values do not
        land as a permutation (an element written twice or never: a layout this cannot map)."""
        h, b, d = num_kv_heads, block_size, head_dim
        if max(b, d, h) > 256 and dtype == torch.bfloat16:
            raise LayoutError(f"probing bf16 pages needs block_size, head_dim and kv_heads "
                              f"<= 256 (exact integers), got {b}, {d}, {h}")
        shape = (b, h, d)
        token = torch.arange(b).view(b, 1, 1).expand(shape)
        head = torch.arange(h).view(1, h, 1).expand(shape)
        dim = torch.arange(d).view(1, 1, d).expand(shape)
        slots = torch.arange(b, dtype=torch.long)
        found = []
        # per pass: what K and what V carry; the K|V pass marks K 1 and V 2 (0: not written)
        for k_vals, v_vals in ((token, token), (head, head), (dim, dim),
                               (torch.ones(shape), torch.full(shape, 2.0))):
            page = torch.full((1, h, b, 2 * d), -1.0, dtype=dtype)
            write(k_vals.to(dtype).contiguous(), v_vals.to(dtype).contiguous(), page, slots)
            found.append(page.reshape(-1).to(torch.float32).round().long())
        tok, hd, dm, kv = found
        if bool((kv < 1).any()) or bool((kv > 2).any()):
            raise LayoutError("the engine's cache write left part of a page unwritten or wrote "
                              "outside it: not a [pages, kv_heads, block_size, 2 * head_dim] "
                              "layout")
        canonical = (((kv - 1) * b + tok) * h + hd) * d + dm
        index = torch.full((2 * b * h * d,), -1, dtype=torch.long)
        index[canonical] = torch.arange(canonical.numel())
        if bool((index < 0).any()):
            raise LayoutError("the engine's cache write does not place every (K|V, token, "
                              "head, dim) element exactly once in a page")
        return cls(index, b, h, d)

    def _flat(self, kv: torch.Tensor) -> torch.Tensor:
        try:
            return kv.view(kv.shape[0], -1)
        except RuntimeError:
            raise LayoutError(f"engine KV tensor {tuple(kv.shape)} with strides {kv.stride()} "
                              "has pages that are not contiguous") from None

    def to_pool(self, layers: Sequence[torch.Tensor], pages: Sequence[int],
                pool_view: torch.Tensor, blocks: Sequence[int]) -> None:
        """Copy engine pages `pages` into pool blocks `blocks` (same order)."""
        if not pages:
            return
        n = len(pages)
        p = _ids(pages, layers[0].device)
        b = _ids(blocks, pool_view.device)
        index = self.index.to(layers[0].device)
        shape = (n, 2, self.block_size, self.num_kv_heads, self.head_dim)
        for i, kv in enumerate(layers):
            rows = self._flat(kv)[p[:, None], index[None, :]]
            pool_view[b, i] = rows.view(shape).to(pool_view.device)

    def from_pool(self, layers: Sequence[torch.Tensor], pages: Sequence[int],
                  pool_view: torch.Tensor, blocks: Sequence[int]) -> None:
        """Copy pool blocks `blocks` into engine pages `pages` (same order)."""
        if not pages:
            return
        n = len(pages)
        p = _ids(pages, layers[0].device)
        b = _ids(blocks, pool_view.device)
        index = self.index.to(layers[0].device)
        for i, kv in enumerate(layers):
            flat = self._flat(kv)
            flat[p[:, None], index[None, :]] = pool_view[b, i].reshape(n, -1).to(kv.device)


Pages = FlashPages | ProbedPages


def describe(kv: torch.Tensor) -> str:
    return f"{tuple(kv.shape)} {kv.dtype} on {kv.device}"


def check_layers(layers: Sequence[torch.Tensor], pages: Any, num_kv_heads: int,
                 block_size: int, head_dim: int) -> None:
    """LayoutError unless every layer tensor has the shape `pages` expects."""
    for kv in layers:
        if isinstance(pages, FlashPages):
            ok = kv.dim() == 5 and kv.shape[0] == 2 and tuple(kv.shape[2:]) == (
                block_size, num_kv_heads, head_dim)
            want = f"[2, pages, {block_size}, {num_kv_heads}, {head_dim}]"
        else:
            ok = kv.dim() == 4 and tuple(kv.shape[1:]) == (num_kv_heads, block_size,
                                                           2 * head_dim)
            want = f"[pages, {num_kv_heads}, {block_size}, {2 * head_dim}]"
        if not ok:
            raise LayoutError(f"engine KV tensor {describe(kv)} is not {want}")
