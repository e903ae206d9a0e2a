"""The geometry of one model's KV cache cut into blocks (`KVLayout`) and its byte math.
Allocates nothing. Where a geometry comes from (presets, a Hugging Face config): kvpool/models.py;
byte units: kvpool/units.py (both re-exported here).

KV bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element.
LLaMA-3-70B (80 layers, 8 KV heads, head_dim 128, bf16): 2 x 80 x 8 x 128 x 2 = 327,680 B/token.

Quantized dtypes (int8, int4) also store fp16 scales inside each block, and the byte math counts
them segment by segment (`KVLayout.segments`; the codecs: kvpool/codecs.py):
  int8  symmetric, one scale per (token, kv_head, group of `group_size` elements; 0: the head)
  int4  asymmetric (scale + minimum), two values a byte; keys per channel over the block's tokens
        (`key_scales="channel"`, KIVI) or per token groups ("token"); values per token groups.
`sink_tokens`: the first tokens of every sequence ("attention sinks") stay in `model_dtype`; they
live in sink blocks, a region of the pool whose blocks carry them after the quantized part.

Sliding-window attention (`sliding_window` W on `window_layers`, as a value `KVLayout.window`;
kvpool/window.py reads the layers from a flag, kvpool/models.py from a model config): a
windowed layer needs only the KV of the last W - 1 tokens before the resume point,
ceil((W - 1) / block_size) blocks, while full layers need every block. Each layer is an equal
share of a block (every segment has the layer as its first axis), so `full_bytes_per_block` +
`window_bytes_per_block` = `bytes_per_block`; `conversation_bytes` counts a cached conversation
both ways. A windowed pool stores the two kinds apart (kvpool/slab.py): full parts and window
parts, each laid out as a plain layout of its own layers (`full_part()`, `window_part()`), so
the block codecs work on either unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from kvpool.errors import InvalidArgument
from kvpool.models import PRESET_MODELS, ModelGeometry, geometry_from_hf_config
from kvpool.units import format_bytes, parse_bytes
from kvpool.window import SlidingWindow, check_window, parse_window_layers

__all__ = ["DTYPE_BITS", "KEY_SCALES", "MODEL_DTYPES", "PRESETS", "QUANTIZED", "SCALE_BYTES",
           "SINK_TOKENS", "KVLayout", "format_bytes", "parse_bytes"]

DTYPE_BITS: dict[str, int] = {"fp32": 32, "fp16": 16, "bf16": 16, "fp8": 8, "int8": 8, "int4": 4}
QUANTIZED = ("int8", "int4")
MODEL_DTYPES = ("fp32", "fp16", "bf16")
KEY_SCALES = ("channel", "token")
SCALE_BYTES = 2  # fp16 scales
SINK_TOKENS = 4  # the serve default for quantized pools


@dataclass(frozen=True, slots=True)
class KVLayout:
    """One model's KV geometry. A pool block holds `block_size` tokens laid out as
    `[num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]`, contiguous."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bf16"
    block_size: int = 16
    # quantized layouts only: the engine's dtype (sinks, dequantized K/V), scale grouping, sinks
    model_dtype: str = "bf16"
    group_size: int = 0
    key_scales: str = "channel"
    sink_tokens: int = 0
    # sliding-window attention: None is full attention on every layer (then window_layers is ())
    sliding_window: int | None = None
    window_layers: tuple[int, ...] = ()  # the windowed layers' indices, increasing

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidArgument(f"KVLayout.{name} must be a positive integer, got {value!r}")
        if self.dtype not in DTYPE_BITS:
            raise InvalidArgument(
                f"KVLayout.dtype {self.dtype!r} is not one of {', '.join(DTYPE_BITS)}"
            )
        if self.dtype == "int4" and self.head_dim % 2:
            raise InvalidArgument(f"int4 packs two values a byte: head_dim {self.head_dim} is odd")
        if self.model_dtype not in MODEL_DTYPES:
            raise InvalidArgument(f"KVLayout.model_dtype {self.model_dtype!r} is not one of "
                                  f"{', '.join(MODEL_DTYPES)}")
        if self.key_scales not in KEY_SCALES:
            raise InvalidArgument(f"KVLayout.key_scales {self.key_scales!r} is not one of "
                                  f"{', '.join(KEY_SCALES)}")
        for name in ("group_size", "sink_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgument(f"KVLayout.{name} must be an integer >= 0, got {value!r}")
        if self.group_size and self.head_dim % self.group_size:
            raise InvalidArgument(f"group size {self.group_size} does not divide head_dim "
                                  f"{self.head_dim}")
        if self.sink_tokens and not self.is_quantized:
            raise InvalidArgument(f"sink tokens keep the first tokens of a quantized cache in "
                                  f"the model dtype; dtype {self.dtype} is not quantized")
        if self.sink_tokens >= self.block_size:
            raise InvalidArgument(f"sink tokens ({self.sink_tokens}) must be fewer than the "
                                  f"block size ({self.block_size}): they are the start of a "
                                  f"sequence's first block")
        if self.sliding_window is None:
            if self.window_layers:
                raise InvalidArgument("KVLayout.window_layers without a sliding_window")
        else:
            SlidingWindow(self.sliding_window, self.window_layers, self.num_layers)  # checks

    def __repr__(self) -> str:
        """The dataclass repr; the window fields only when there is a window (the layers as
        their --window-layers spec)."""
        names = ["num_layers", "num_kv_heads", "head_dim", "dtype", "block_size", "model_dtype",
                 "group_size", "key_scales", "sink_tokens"]
        text = ", ".join(f"{n}={getattr(self, n)!r}" for n in names)
        if self.sliding_window is not None:
            text += (f", sliding_window={self.sliding_window}, "
                     f"window_layers={self.window_pattern!r}")
        return f"KVLayout({text})"

    @property
    def elements_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @property
    def data_bytes_per_token(self) -> int:
        """K and V values only, without quantization scales."""
        return self.elements_per_token * DTYPE_BITS[self.dtype] // 8

    @property
    def group(self) -> int:
        """Elements per scale along head_dim (quantized layouts)."""
        return self.group_size or self.head_dim

    def segments(self) -> list[tuple[str, tuple[int, ...], int]]:
        """A quantized block's parts in byte order: (name, shape, bytes per element)."""
        L, B, H, D = self.num_layers, self.block_size, self.num_kv_heads, self.head_dim
        token_scales = (L, B, H, D // self.group)
        if self.dtype == "int8":
            return [("data", (L, 2, B, H, D), 1), ("k_scale", token_scales, SCALE_BYTES),
                    ("v_scale", token_scales, SCALE_BYTES)]
        if self.dtype != "int4":
            return [("data", self.block_shape, DTYPE_BITS[self.dtype] // 8)]
        keys = (L, H, D) if self.key_scales == "channel" else token_scales
        return [("data", (L, 2, B, H, D // 2), 1),
                ("k_scale", keys, SCALE_BYTES), ("k_zero", keys, SCALE_BYTES),
                ("v_scale", token_scales, SCALE_BYTES), ("v_zero", token_scales, SCALE_BYTES)]

    @property
    def bytes_per_block(self) -> int:
        """Values plus their scales, for `block_size` tokens."""
        return sum(itemsize * math.prod(shape) for _, shape, itemsize in self.segments())

    @property
    def sink_bytes(self) -> int:
        """The first `sink_tokens` tokens of a sequence in the model dtype."""
        return (self.sink_tokens * 2 * self.num_layers * self.num_kv_heads * self.head_dim
                * DTYPE_BITS[self.model_dtype] // 8)

    @property
    def sink_bytes_per_block(self) -> int:
        """A sink block: a quantized block followed by its sink tokens at full precision."""
        return self.bytes_per_block + self.sink_bytes

    @property
    def scale_bytes_per_token(self) -> int:
        """Bytes of quantization scales per token, rounded up (0 for fp32/fp16/bf16/fp8)."""
        return self.bytes_per_token - self.data_bytes_per_token

    @property
    def bytes_per_token(self) -> int:
        """What one cached token costs, values plus scales (rounded up to a byte when the
        scales are per block)."""
        return -(-self.bytes_per_block // self.block_size)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block in elements: (layers, 2, block_size, kv_heads, head_dim)."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def is_quantized(self) -> bool:
        return self.dtype in QUANTIZED

    # -- sliding-window attention ---------------------------------------------------------------

    @property
    def is_windowed(self) -> bool:
        """Some layers use sliding-window attention."""
        return self.sliding_window is not None

    @property
    def window(self) -> SlidingWindow | None:
        """The attention pattern as a value; None: full attention on every layer."""
        if self.sliding_window is None:
            return None
        return SlidingWindow(self.sliding_window, self.window_layers, self.num_layers)

    @property
    def window_pattern(self) -> str:
        """The windowed layers as a --window-layers spec ("all", "alternate", "5:1", "0-3,8");
        "" without a window."""
        window = self.window
        return window.pattern if window is not None else ""

    @property
    def full_layers(self) -> tuple[int, ...]:
        """Indices of the full-attention layers."""
        window = self.window
        return window.full_layers if window is not None else tuple(range(self.num_layers))

    @property
    def layer_bytes_per_block(self) -> int:
        """One layer's share of a block, values plus scales (exact: every segment has the
        layer as its first axis)."""
        if not self.num_layers:  # the empty full part of an all-windowed layout
            return 0
        return self.bytes_per_block // self.num_layers

    @property
    def full_bytes_per_block(self) -> int:
        """The full-attention layers' part of a block."""
        return (self.num_layers - len(self.window_layers)) * self.layer_bytes_per_block

    @property
    def window_bytes_per_block(self) -> int:
        """The windowed layers' part of a block (0 without a window)."""
        return len(self.window_layers) * self.layer_bytes_per_block

    @property
    def full_bytes_per_token(self) -> int:
        """What one token costs in the full-attention layers (rounded up to a byte)."""
        return -(-self.full_bytes_per_block // self.block_size)

    @property
    def window_bytes_per_token(self) -> int:
        """What one token costs in the windowed layers (rounded up to a byte; 0 without a
        window). Unquantized, full + window bytes per token = `bytes_per_token`."""
        return -(-self.window_bytes_per_block // self.block_size)

    @property
    def window_blocks(self) -> int:
        """Blocks a windowed layer keeps behind a block-aligned resume point p: positions
        [p - W + 1, p), ceil((W - 1) / block_size) blocks (0 without a window)."""
        window = self.window
        return window.blocks(self.block_size) if window is not None else 0

    def full_part(self) -> KVLayout:
        """The full-attention layers as a layout of their own, as a windowed pool stores them:
        `num_layers` = len(full_layers), no window, every other field the same (so
        `bytes_per_block` = this layout's `full_bytes_per_block`). Without a window: this
        layout. All-windowed (no full layer): a layout of 0 layers and 0 bytes, which only
        this method makes (KVLayout refuses 0 layers from anyone else; `replace` on it raises)."""
        if not self.is_windowed:
            return self
        return self._part(self.num_layers - len(self.window_layers))

    def window_part(self) -> KVLayout:
        """The windowed layers as a layout of their own (`num_layers` = len(window_layers), no
        window, every other field the same). InvalidArgument without a window."""
        if not self.is_windowed:
            raise InvalidArgument(f"{self!r} has no sliding window: it has no window part")
        return self._part(len(self.window_layers))

    def _part(self, num_layers: int) -> KVLayout:
        if num_layers:
            return replace(self, num_layers=num_layers, sliding_window=None, window_layers=())
        part = object.__new__(KVLayout)  # 0 layers: past __post_init__, which refuses them
        for f in fields(self):
            object.__setattr__(part, f.name, getattr(self, f.name))
        object.__setattr__(part, "num_layers", 0)
        object.__setattr__(part, "sliding_window", None)
        object.__setattr__(part, "window_layers", ())
        return part

    def conversation_blocks(self, num_tokens: int) -> int:
        """Blocks one cached conversation of `num_tokens` tokens spans: ceil(T / block_size)."""
        if num_tokens < 0:
            raise InvalidArgument(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size)

    def conversation_bytes(self, num_tokens: int, windowed: bool = True) -> int:
        """Pool bytes one cached conversation of `num_tokens` tokens holds, in whole blocks
        (`conversation_blocks`), sink tokens included. `windowed`: the windowed layers keep only
        their last `window_blocks` blocks (and the sequence's sink tokens only while the window
        still reaches block 0); False: every layer is treated as full. Without a window both
        are the same."""
        blocks = self.conversation_blocks(num_tokens)
        sinks = self.sink_bytes if blocks else 0
        if not windowed or not self.is_windowed:
            return blocks * self.bytes_per_block + sinks
        kept = min(blocks, self.window_blocks)
        layer_sinks = sinks // self.num_layers
        window_sinks = layer_sinks * len(self.window_layers) if kept == blocks else 0
        return (blocks * self.full_bytes_per_block + sinks - layer_sinks * len(self.window_layers)
                + kept * self.window_bytes_per_block + window_sinks)

    def with_window(self, sliding_window: int | None,
                    layers: str | Sequence[int] = "all") -> KVLayout:
        """This geometry with a sliding window of `sliding_window` tokens on `layers` (a
        --window-layers spec or layer indices); None: full attention on every layer."""
        if sliding_window is None:
            return replace(self, sliding_window=None, window_layers=())
        check_window(sliding_window)
        picked = (parse_window_layers(layers, self.num_layers) if isinstance(layers, str)
                  else tuple(sorted(set(layers))))
        return replace(self, sliding_window=sliding_window, window_layers=picked)

    def context_bytes(self, num_tokens: int) -> int:
        """KV bytes for one context of `num_tokens` tokens, sink tokens included."""
        if num_tokens < 0:
            raise InvalidArgument(f"num_tokens must be >= 0, got {num_tokens}")
        if not self.is_quantized:
            return num_tokens * self.bytes_per_token
        sinks = self.sink_bytes if num_tokens else 0
        return -(-num_tokens * self.bytes_per_block // self.block_size) + sinks

    def tokens_in(self, memory_bytes: int) -> int:
        """How many tokens (whole blocks) fit in `memory_bytes` of pool."""
        return self.blocks_in(memory_bytes) * self.block_size

    def blocks_in(self, memory_bytes: int) -> int:
        if not self.bytes_per_block:
            raise InvalidArgument(f"{self!r} takes 0 bytes per block: any number fits")
        return memory_bytes // self.bytes_per_block

    def with_dtype(self, dtype: str, sink_tokens: int | None = None) -> KVLayout:
        """This geometry stored as `dtype`. Quantizing a full-precision layout makes its dtype
        the model dtype (and gives it SINK_TOKENS sinks unless told); de-quantizing drops the
        quantization fields."""
        if dtype in QUANTIZED:
            model = self.model_dtype if self.is_quantized or self.dtype not in MODEL_DTYPES \
                else self.dtype
            sinks = self.sink_tokens if self.is_quantized else SINK_TOKENS
            return replace(self, dtype=dtype, model_dtype=model,
                           sink_tokens=sinks if sink_tokens is None else sink_tokens)
        return replace(self, dtype=dtype, model_dtype="bf16", group_size=0,
                       key_scales="channel", sink_tokens=0)

    def to_dict(self) -> dict[str, Any]:
        """The fields; the window ones only when there is a window (JSON-safe: a list)."""
        out = asdict(self)
        if self.sliding_window is None:
            del out["sliding_window"], out["window_layers"]
        else:
            out["window_layers"] = list(self.window_layers)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVLayout:
        fields = ("num_layers", "num_kv_heads", "head_dim", "dtype", "block_size", "model_dtype",
                  "group_size", "key_scales", "sink_tokens", "sliding_window")
        out = {k: data[k] for k in fields if k in data}
        if "window_layers" in data:
            layers = data["window_layers"]
            out["window_layers"] = tuple(layers) if isinstance(layers, list) else layers
        return cls(**out)

    @classmethod
    def from_geometry(cls, geometry: ModelGeometry, block_size: int = 16) -> KVLayout:
        """A model's geometry (kvpool/models.py) cut into blocks of `block_size` tokens."""
        g = geometry
        return cls(g.num_layers, g.num_kv_heads, g.head_dim, g.dtype, block_size,
                   sliding_window=g.sliding_window, window_layers=g.window_layers)

    @classmethod
    def from_preset(cls, name: str, dtype: str | None = None, block_size: int = 16) -> KVLayout:
        try:
            geometry = PRESET_MODELS[name.lower()]
        except KeyError:
            raise InvalidArgument(
                f"unknown preset {name!r}; known: {', '.join(sorted(PRESET_MODELS))}"
            ) from None
        lay = cls.from_geometry(geometry, block_size)
        return lay.with_dtype(dtype) if dtype else lay

    @classmethod
    def from_hf_config(
        cls, config: dict[str, Any] | str | Path, dtype: str | None = None, block_size: int = 16
    ) -> KVLayout:
        """Build from a Hugging Face `config.json` (a dict or a path; what is read:
        kvpool.models.geometry_from_hf_config); dtype from torch_dtype unless given."""
        lay = cls.from_geometry(geometry_from_hf_config(config), block_size)
        return lay.with_dtype(dtype) if dtype else lay


# The published architectures of kvpool/models.py at block size 16.
PRESETS: dict[str, KVLayout] = {name: KVLayout.from_geometry(g)
                                for name, g in PRESET_MODELS.items()}
