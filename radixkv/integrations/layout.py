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
  canonical element, and where it is one, a strided view of the page per K and V half; copies
  are bit-exact in any dtype. Strided pages are copied by a native kernel (pages_kernel.py: one
  GIL-free call per copy, about memcpy's cost) where it is built; else loads go through the
  engine's own cache write and saves through strided views.

Copies take block ids on both sides (engine pages and pool blocks, equal block sizes) and run on
the tensors' device; on CUDA they are queued on the current stream (synchronize before telling
the service the blocks are written or may be reused).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from radixkv.integrations import pages_kernel

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
        self._copy(layers, pages, pool_view, blocks, to_pool=True)

    def from_pool(self, layers: Sequence[torch.Tensor], pages: Sequence[int],
                  pool_view: torch.Tensor, blocks: Sequence[int]) -> None:
        """Copy pool blocks `blocks` into engine pages `pages` (same order)."""
        self._copy(layers, pages, pool_view, blocks, to_pool=False)

    def _copy(self, layers: Sequence[torch.Tensor], pages: Sequence[int],
              pool_view: torch.Tensor, blocks: Sequence[int], to_pool: bool) -> None:
        """Between engine pages and pool blocks, either way: layer i of a page is
        kv[i][:, page] ([2, block, heads, dim]), of a block pool_view[block, i]."""
        if not pages:
            return
        p, b = _ids(pages, layers[0].device), _ids(blocks, pool_view.device)
        for i, kv in enumerate(layers):
            engine: tuple[torch.Tensor, Any] = (kv, (slice(None), p))  # [2, n, block, ...]
            pool: tuple[torch.Tensor, Any] = (pool_view, (b, i))  # [n, 2, block, ...]
            (dst, at), (src, of) = (pool, engine) if to_pool else (engine, pool)
            dst[at] = src[of].transpose(0, 1).to(dst.device)


@dataclass(frozen=True)
class ProbedPages:
    """Per layer [num_pages, kv_heads, block_size, 2 * head_dim], each page's interior given by
    `index`: index[c] is the position, in the page's flat kv_heads*block_size*2*head_dim
    elements, of canonical element c of [2, block_size, kv_heads, head_dim].

    Copies take the fastest path that applies: when K and V are each an affine function of
    their canonical position (`strided`: vLLM's AMX and AVX-512 pages are), the native kernel
    (pages_kernel.py; `kernel=False` or RADIXKV_NO_KERNEL=1 skips it); into engine pages
    through `write` (the engine's cache write kept from the probe); as strided views;
    otherwise one gather or scatter per layer through `index`."""

    index: torch.Tensor  # int64 [2 * block_size * kv_heads * head_dim]
    block_size: int
    num_kv_heads: int
    head_dim: int
    strided: tuple[Strided, Strided] | None = None  # K and V as strided views, if they are
    write: CacheWrite | None = field(default=None, compare=False, repr=False)
    kernel: bool = field(default=True, compare=False)  # try pages_kernel first

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
        return cls(index, b, h, d, Strided.of(index.view(2, -1), (b, h, d)), write)

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
        if self._copy_kernel(layers, pages, pool_view, blocks, to_pool=True):
            return
        if self._copy_strided(layers, pages, pool_view, blocks, to_pool=True):
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
        if self._copy_kernel(layers, pages, pool_view, blocks, to_pool=False):
            return
        if self._write_pages(layers, pages, pool_view, blocks):
            return
        if self._copy_strided(layers, pages, pool_view, blocks, to_pool=False):
            return
        n = len(pages)
        p = _ids(pages, layers[0].device)
        b = _ids(blocks, pool_view.device)
        index = self.index.to(layers[0].device)
        for i, kv in enumerate(layers):
            flat = self._flat(kv)
            flat[p[:, None], index[None, :]] = pool_view[b, i].reshape(n, -1).to(kv.device)

    def _copy_kernel(self, layers: Sequence[torch.Tensor], pages: Sequence[int],
                     pool_view: torch.Tensor, blocks: Sequence[int], to_pool: bool) -> bool:
        """The copy through pages_kernel (all layers and pages in one call); False when it is
        off, unavailable, or the page interior or the tensors are not what it covers."""
        kv0 = layers[0]
        b, h, d = self.block_size, self.num_kv_heads, self.head_dim
        page = (2 * b * h * d, b * 2 * d, 2 * d, 1)  # [pages, heads, block, 2 * dim] strides
        if (not self.kernel or self.strided is None or kv0.device.type != "cpu"
                or pool_view.device != kv0.device or pool_view.dtype != kv0.dtype
                or pool_view.dim() != 6 or pool_view.shape[1] != len(layers)
                or pool_view.stride()[2:] != (b * h * d, h * d, d, 1)):
            return False
        if any(kv.dtype != kv0.dtype or kv.stride() != page for kv in layers):
            return False
        return pages_kernel.copy(layers, _ids(pages, kv0.device), pool_view,
                                 _ids(blocks, kv0.device), self.strided, to_pool)

    def _write_pages(self, layers: Sequence[torch.Tensor], pages: Sequence[int],
                     pool_view: torch.Tensor, blocks: Sequence[int]) -> bool:
        """Pool blocks into engine pages through the engine's own cache write (its kernel packs
        a page faster than a strided copy: measured in docs/vllm.md), block by block."""
        kv0 = layers[0]
        if self.write is None or pool_view.device != kv0.device or pool_view.dtype != kv0.dtype:
            return False
        b = self.block_size
        for p, blk in zip(pages, blocks, strict=True):
            slots = torch.arange(p * b, (p + 1) * b, dtype=torch.long, device=kv0.device)
            block = pool_view[blk]  # [layers, 2, block, heads, dim]: K and V token-major
            for i, kv in enumerate(layers):
                self.write(block[i, 0], block[i, 1], kv, slots)
        return True

    def _copy_strided(self, layers: Sequence[torch.Tensor], pages: Sequence[int],
                      pool_view: torch.Tensor, blocks: Sequence[int], to_pool: bool) -> bool:
        """The copy as strided views, page by page (all layers at once when they lie evenly
        spaced in one storage); False when the page interior or the tensors do not allow it."""
        kv0 = layers[0]
        page = 2 * self.block_size * self.num_kv_heads * self.head_dim
        if (self.strided is None or pool_view.device != kv0.device
                or pool_view.dtype != kv0.dtype or not pool_view[0].is_contiguous()):
            return False
        for kv in layers:
            if kv.stride() != kv0.stride() or kv.stride(0) != page or not kv[0].is_contiguous():
                return False
        groups = _stacked(layers)
        for p, b in zip(pages, blocks, strict=True):
            block = pool_view[b]  # [layers, 2, block, heads, dim], contiguous
            for first, count, step in groups:
                for half, view in enumerate(self.strided):
                    engine = view.of_page(layers[first], p, count, step)
                    pool = view.canonical(block, first, count, half)
                    if to_pool:
                        pool.copy_(engine)
                    else:
                        engine.copy_(pool)
        return True


def _stacked(layers: Sequence[torch.Tensor]) -> list[tuple[int, int, int]]:
    """(first layer, layer count, storage step between layers): one group when every layer lies
    in one storage evenly spaced, else one group per layer."""
    kv0 = layers[0]
    if len(layers) > 1:
        step = int(layers[1].storage_offset() - kv0.storage_offset())
        ptr = kv0.untyped_storage().data_ptr()
        if step > 0 and all(kv.untyped_storage().data_ptr() == ptr
                            and kv.storage_offset() == kv0.storage_offset() + i * step
                            for i, kv in enumerate(layers)):
            return [(0, len(layers), step)]
    return [(i, 1, 0) for i in range(len(layers))]


@dataclass(frozen=True)
class Strided:
    """Where one half (K or V) of a page's canonical [block, heads, dim] elements lie, as a
    strided view of the page: `offset` of element 0, then `sizes` and `strides` (in elements,
    most significant first) over the canonical elements' mixed-radix digits."""

    offset: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]

    @classmethod
    def of(cls, index: torch.Tensor, shape: tuple[int, int, int]) -> tuple[Strided, Strided] | None:
        """Both halves of `index` ([2, n] page positions), or None if either is not an affine
        function of its canonical digits (each axis cut into factors of 2 and an odd rest)."""
        halves = [cls._affine(half, shape) for half in index]
        return (halves[0], halves[1]) if halves[0] and halves[1] else None

    @classmethod
    def _affine(cls, positions: torch.Tensor, shape: tuple[int, ...]) -> Strided | None:
        digits: list[tuple[int, int]] = []  # (size, canonical stride), least significant first
        step = 1
        for size in reversed(shape):
            while size > 1:
                d = 2 if size % 2 == 0 else size
                digits.append((d, step))
                step, size = step * d, size // d
        base = int(positions[0])
        c = torch.arange(positions.numel())
        predicted = torch.full_like(c, base)
        sizes: list[int] = []
        strides: list[int] = []
        for d, canonical in digits:
            stride = int(positions[canonical]) - base
            predicted += (c // canonical % d) * stride
            if sizes and strides[-1] * sizes[-1] == stride:  # merge with the digit below
                sizes[-1] *= d
            else:
                sizes.append(d)
                strides.append(stride)
        if not torch.equal(predicted, positions):
            return None
        return cls(base, tuple(reversed(sizes)), tuple(reversed(strides)))

    def of_page(self, kv: torch.Tensor, page: int, count: int, step: int) -> torch.Tensor:
        """[count layers, *sizes]: this half of `page` in `count` layers from `kv` on."""
        return kv.as_strided((count, *self.sizes), (step, *self.strides),
                             kv.storage_offset() + page * kv.stride(0) + self.offset)

    def canonical(self, block: torch.Tensor, first: int, count: int,
                  half: int) -> torch.Tensor:
        """The same elements of a pool block [layers, 2, block, heads, dim]."""
        inner = [1] * len(self.sizes)
        for i in range(len(self.sizes) - 2, -1, -1):
            inner[i] = inner[i + 1] * self.sizes[i + 1]
        return block.as_strided((count, *self.sizes), (block.stride(0), *inner),
                                block.storage_offset() + first * block.stride(0)
                                + half * block.stride(1))


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


# ---- SGLang's HiCache host pool ---------------------------------------------------------------

TORCH_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class HostPages:
    """SGLang's HiCache host KV pool (MHATokenToKVPoolHost.kv_buffer), whose pages are given by
    their first token slot (`slots`, one per page):

    - page_first: [2, slots, layers, kv_heads, head_dim]; a page is slots s..s+page_size-1;
    - page_first_direct: [2, pages, layers, page_size, kv_heads, head_dim]; slot s is in page
      s // page_size.

    Each run of pages consecutive in both pools is one strided copy between views (on CPU,
    torch's indexed gather / scatter of fp16 pages measured an order of magnitude slower)."""

    layout: str  # "page_first" | "page_first_direct"
    page_size: int

    LAYOUTS = ("page_first", "page_first_direct")

    def __post_init__(self) -> None:
        if self.layout not in self.LAYOUTS:
            raise LayoutError(f"SGLang host pool layout {self.layout!r} is not supported "
                              f"(use --hicache-mem-layout {' or '.join(self.LAYOUTS)})")

    def _pages(self, kv: torch.Tensor, slot: int, count: int) -> torch.Tensor:
        """`count` host pages from the one starting at `slot` on (consecutive slots), as a view
        in the canonical [count, layers, 2, block, heads, dim] order."""
        if self.layout == "page_first":
            run = kv[:, slot:slot + count * self.page_size]  # [2, tokens, layers, heads, dim]
            return run.view(2, count, self.page_size, *run.shape[2:]).permute(1, 3, 0, 2, 4, 5)
        page = slot // self.page_size  # [2, pages, layers, page, heads, dim]
        return kv[:, page:page + count].permute(1, 2, 0, 3, 4, 5)

    def copy(self, kv: torch.Tensor, slots: torch.Tensor, pool_view: torch.Tensor,
             blocks: Sequence[int], to_pool: bool) -> None:
        """Copy between the host pages at `slots` (their first slots) and pool blocks `blocks`
        (same order): into the pool with `to_pool`, else out of it. Each run of pages that are
        consecutive on both sides is one strided copy."""
        for slot, block, count in self.runs(slots.tolist(), list(blocks)):
            host = self._pages(kv, slot, count)
            pool = pool_view[block:block + count]
            if to_pool:
                pool.copy_(host)
            else:
                host.copy_(pool)

    def runs(self, slots: list[int], blocks: list[int]) -> list[tuple[int, int, int]]:
        """(first slot, first block, pages) of each run of pages consecutive in both the host
        pool and radixkv's pool."""
        if len(slots) != len(blocks):
            raise ValueError(f"{len(slots)} host pages for {len(blocks)} pool blocks")
        out: list[tuple[int, int, int]] = []
        for slot, block in zip(slots, blocks, strict=True):
            if out:
                first, start, count = out[-1]
                if slot == first + count * self.page_size and block == start + count:
                    out[-1] = (first, start, count + 1)
                    continue
            out.append((slot, block, 1))
        return out
