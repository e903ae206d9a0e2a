"""Block formats as codecs: how a region's bytes are typed as a view, and how its blocks become
engine-layout K/V (`gather`) and back (`scatter`). One codec per format:

    PlainCodec   fp32 / fp16 / bf16 / fp8   [n, layers, 2, block_size, kv_heads, head_dim]
                                            copied as they are (kvpool/copy.py)
    Int8Codec    int8, symmetric            uint8 [n, bytes_per_block]: values and scales,
    Int4Codec    int4, asymmetric           (de)quantized on the way (kvpool/quant.py)

The engine side of both directions is the same for every format: k, v of
[layers, tokens, kv_heads, head_dim], tokens = len(block_ids) x block_size, in block order.
A slab holds one codec per region layout (`codec_for`) and never asks which format it has.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from kvpool import copy, quant
from kvpool.layout import KVLayout

if TYPE_CHECKING:
    import torch

# Element types of the typed views. numpy has no bfloat16 or float8: numpy views of those pools
# hold the raw bits (uint16 for bf16, uint8 for fp8); reinterpret with torch or ml_dtypes.
TORCH_DTYPES: dict[str, str] = {
    "fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp8": "float8_e4m3fn",
}
NUMPY_DTYPES: dict[str, type[np.generic]] = {
    "fp32": np.float32, "fp16": np.float16, "bf16": np.uint16, "fp8": np.uint8,
}

KV = tuple["torch.Tensor", "torch.Tensor"]


class BlockCodec(ABC):
    """One block format over blocks of `layout`. `blocks` is a region's typed view (`view`),
    `sinks` the sink region's uint8 rows (ids after the blocks'; empty for formats and regions
    without sink tokens)."""

    dtypes: ClassVar[tuple[str, ...]]

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout

    @abstractmethod
    def view(self, raw: torch.Tensor, n: int) -> torch.Tensor:
        """`n` blocks' bytes (1-d uint8, zero-copy) as this format's typed view."""

    @abstractmethod
    def numpy_view(self, raw: np.ndarray[Any, Any], n: int) -> np.ndarray[Any, Any]:
        """The same as a numpy array (host pools)."""

    @abstractmethod
    def gather(self, blocks: torch.Tensor, sinks: torch.Tensor, block_ids: Sequence[int], *,
               out: KV | None = None) -> KV:
        """Blocks `block_ids` as engine-layout (k, v) in the model dtype (a copy); `out=(k, v)`
        to fill instead of allocating."""

    @abstractmethod
    def scatter(self, blocks: torch.Tensor, sinks: torch.Tensor, block_ids: Sequence[int],
                k: torch.Tensor, v: torch.Tensor) -> None:
        """Write engine-layout k, v (any float dtype, converted) into the distinct blocks
        `block_ids`. On cuda the copy is queued: synchronize before publishing the blocks."""


class PlainCodec(BlockCodec):
    """Values stored as the engine holds them: a block is [layers, 2, block_size, kv_heads,
    head_dim] of the dtype, and both directions are bit-exact copies."""

    dtypes = ("fp32", "fp16", "bf16", "fp8")

    def view(self, raw: torch.Tensor, n: int) -> torch.Tensor:
        import torch

        dtype = getattr(torch, TORCH_DTYPES[self.layout.dtype])
        return raw.view(dtype).view(n, *self.layout.block_shape)

    def numpy_view(self, raw: np.ndarray[Any, Any], n: int) -> np.ndarray[Any, Any]:
        return raw.view(NUMPY_DTYPES[self.layout.dtype]).reshape(n, *self.layout.block_shape)

    def gather(self, blocks: torch.Tensor, sinks: torch.Tensor, block_ids: Sequence[int], *,
               out: KV | None = None) -> KV:
        return copy.gather(blocks, block_ids, out=out)

    def scatter(self, blocks: torch.Tensor, sinks: torch.Tensor, block_ids: Sequence[int],
                k: torch.Tensor, v: torch.Tensor) -> None:
        copy.scatter(blocks, block_ids, k.to(blocks.device, blocks.dtype),
                v.to(blocks.device, blocks.dtype))


class QuantizedCodec(BlockCodec):
    """Values and their fp16 scales in one row of `bytes_per_block` bytes (segments:
    `KVLayout.segments`); a sink block's row also carries its sequence's first tokens in the
    model dtype. `gather` dequantizes, `scatter` quantizes (refusing NaN and Inf before it
    writes anything)."""

    def view(self, raw: torch.Tensor, n: int) -> torch.Tensor:
        return raw.view(n, self.layout.bytes_per_block)

    def numpy_view(self, raw: np.ndarray[Any, Any], n: int) -> np.ndarray[Any, Any]:
        return raw.reshape(n, self.layout.bytes_per_block)

    def gather(self, blocks: torch.Tensor, sinks: torch.Tensor, block_ids: Sequence[int], *,
               out: KV | None = None) -> KV:
        return quant.gather(self.layout, blocks, sinks, block_ids, out=out)

    def scatter(self, blocks: torch.Tensor, sinks: torch.Tensor, block_ids: Sequence[int],
                k: torch.Tensor, v: torch.Tensor) -> None:
        quant.scatter(self.layout, blocks, sinks, block_ids, k, v)


class Int8Codec(QuantizedCodec):
    """int8, symmetric absmax: one scale per (token, kv_head, group of head_dim)."""

    dtypes = ("int8",)


class Int4Codec(QuantizedCodec):
    """int4, asymmetric (scale and minimum), two values a byte: keys per channel over the
    block's tokens or per token groups (`key_scales`), values per token groups."""

    dtypes = ("int4",)


CODECS: dict[str, type[BlockCodec]] = {
    dtype: codec for codec in (PlainCodec, Int8Codec, Int4Codec) for dtype in codec.dtypes
}


def codec_for(layout: KVLayout) -> BlockCodec:
    """The codec of `layout`'s block format."""
    return CODECS[layout.dtype](layout)
