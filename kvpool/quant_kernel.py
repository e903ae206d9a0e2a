"""The fused CPU codec for quantized blocks (quant_kernel.cpp): built on first use, then loaded
(kvpool/jit.py: the cache directory, its key and lock, the trust rules).

kvpool/quant.py's torch ops stay the reference and the fallback: CUDA tensors, K/V of
another dtype than fp32/fp16/bf16, `RADIXKV_NO_KERNEL=1`, and any machine where the extension
cannot be built (no compiler, no ninja), which is logged once and never fails a call. Loading
registers torch.ops.radixkv_quant.
"""

from __future__ import annotations

import functools
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpool import jit
from kvpool.jit import cache_dir, disabled
from kvpool.layout import KVLayout

if TYPE_CHECKING:
    import torch

__all__ = ["cache_dir", "disabled", "ops", "usable", "format_of", "build_dir", "KERNEL"]

log = logging.getLogger("kvpool.quant_kernel")

SOURCE = Path(__file__).with_name("quant_kernel.cpp")
NAME = "radixkv_quant"
# no FMA contraction: quant.py's mul and add round one by one
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-strict-aliasing",
          "-fopenmp"]
DTYPE_CODES = {"fp32": 0, "fp16": 1, "bf16": 2}  # quant_kernel.cpp Dtype
OPS = ("decode", "encode")  # what loading the library must register
# encode's answers other than 0 (written): quant_kernel.cpp Refusal
NON_FINITE = 1  # K/V holds NaN or Inf
BEYOND_FP16 = 2  # a scale or minimum would overflow fp16

KERNEL = jit.Kernel(NAME, SOURCE, CFLAGS, ["-fopenmp"], OPS, "quant", "quantized-KV CPU kernel",
                    "the torch-op codec", "10-20 s", log)


def ops() -> Any | None:
    """torch.ops.radixkv_quant, building it on the first call; None when disabled or when it
    cannot be built or loaded (the reason logged once)."""
    return KERNEL.ops()


def build_dir() -> Path:
    """Where this source, these flags, torch, Python and CPU build the kernel (not created)."""
    return KERNEL.build_dir()


def usable(t: torch.Tensor, dtype: torch.dtype) -> Any | None:
    """The ops when the kernel applies to pool rows `t` and K/V of `dtype`, else None."""
    import torch

    if t.device.type != "cpu" or dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return None
    return ops()


@functools.lru_cache(maxsize=64)
def format_of(layout: KVLayout) -> tuple[int, ...]:
    """The layout as quant_kernel.cpp's Format reads it: geometry, codec, segment offsets."""
    offsets = {}
    offset = 0
    for name, shape, itemsize in layout.segments():
        offsets[name] = offset
        offset += itemsize * math.prod(shape)
    return (layout.num_layers, layout.block_size, layout.num_kv_heads, layout.head_dim,
            8 if layout.dtype == "int8" else 4, layout.group, int(layout.key_scales == "channel"),
            layout.sink_tokens, DTYPE_CODES[layout.model_dtype], layout.bytes_per_block,
            offsets["data"], offsets["k_scale"], offsets.get("k_zero", 0), offsets["v_scale"],
            offsets.get("v_zero", 0))
