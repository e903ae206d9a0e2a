"""The CPU copy between engine KV pages and pool blocks (pages_kernel.cpp): one call per
copy (all its layers and pages), moving bytes at about memcpy's cost, with the GIL released.

It covers every page interior that `Strided` describes (layout.py: vLLM's CPU pages), in any
dtype, bit for bit. Built on first use and loaded through kvpool/jit.py (the cache directory,
its key and lock, `RADIXKV_NO_KERNEL=1`); where it cannot be built, the warning says so once and
layout.py's torch-op copies serve. Single-threaded, no OpenMP: the vLLM connector's loader runs
it on a CPU of its own.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kvpool import jit

if TYPE_CHECKING:
    import torch

log = logging.getLogger("radixkv.integrations.pages_kernel")

SOURCE = Path(__file__).with_name("pages_kernel.cpp")
NAME = "radixkv_pages"
CFLAGS = ["-O3", "-march=native", "-fno-strict-aliasing"]
OPS = ("copy_pages",)

KERNEL = jit.Kernel(NAME, SOURCE, CFLAGS, [], OPS, "pages", "paged-KV copy kernel",
                    "the torch-op copies", "10-20 s", log)


class Strided(Protocol):
    """One half (K or V) of a page as a strided view of its canonical elements (layout.py's
    `Strided`): offset, then sizes and strides over the canonical digits."""

    @property
    def offset(self) -> int: ...

    @property
    def sizes(self) -> tuple[int, ...]: ...

    @property
    def strides(self) -> tuple[int, ...]: ...


def ops() -> Any | None:
    """torch.ops.radixkv_pages, building it on the first call; None when disabled or when it
    cannot be built or loaded (the reason logged once)."""
    return KERNEL.ops()


@functools.lru_cache(maxsize=32)
def plan(halves: tuple[Strided, Strided], to_pool: bool) -> tuple[int, ...]:
    """The loops of a copy as pages_kernel.cpp reads them: per half (K, V) the unit (elements
    contiguous on both sides), its offset in the page and in the canonical block, the loop
    count, then (size, page stride, canonical stride) per loop, outermost first, ordered by
    the destination's stride (the page's for a load, the block's for a save)."""
    out: list[int] = []
    half_elems = math.prod(halves[0].sizes)
    for half, view in enumerate(halves):
        canon = [math.prod(view.sizes[i + 1:]) for i in range(len(view.sizes))]
        loops = sorted(((s, p, c) for s, p, c in zip(view.sizes, view.strides, canon, strict=True)
                        if s > 1), key=lambda x: x[2] if to_pool else x[1], reverse=True)
        merged: list[tuple[int, int, int]] = []
        for s, p, c in reversed(loops):  # innermost first
            if merged and p == merged[-1][1] * merged[-1][0] and c == merged[-1][2] * merged[-1][0]:
                size, page, can = merged[-1]
                merged[-1] = (size * s, page, can)
            else:
                merged.append((s, p, c))
        unit = 1
        if merged and merged[0][1] == 1 and merged[0][2] == 1:
            unit = merged.pop(0)[0]
        # innermost: the loop contiguous on the destination, then the one contiguous on the
        # source (any order copies the same; this one lets the kernel move 16 units at a time)
        dst, src = (2, 1) if to_pool else (1, 2)
        for side in (src, dst):
            at = next((i for i, loop in enumerate(merged) if loop[side] == unit), None)
            if at is not None:
                merged.insert(0, merged.pop(at))
        out += [unit, view.offset, half * half_elems, len(merged)]
        for loop in reversed(merged):
            out += loop
    return tuple(out)


def copy(layers: Sequence[torch.Tensor], pages: torch.Tensor, pool_view: torch.Tensor,
         blocks: torch.Tensor, halves: tuple[Strided, Strided], to_pool: bool) -> bool:
    """Between pages `pages` of every engine layer and pool blocks `blocks` (layer j of a block
    is pool_view[block, j]); False (nothing copied) when the kernel is unavailable."""
    kernel = ops()
    if kernel is None:
        return False
    kernel.copy_pages(list(layers), pool_view, pages, blocks, list(plan(halves, to_pool)),
                      to_pool)
    return True
