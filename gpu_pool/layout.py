"""The geometry of one model's KV cache and the memory calculator. Allocates nothing.

KV bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element.
LLaMA-3-70B (80 layers, 8 KV heads, head_dim 128, bf16): 2 x 80 x 8 x 128 x 2 = 327,680 B/token.

Quantized dtypes (int8, int4) also store fp16 scales inside each block, and the byte math counts
them segment by segment (`KVLayout.segments`; the codec is gpu_pool/quant.py):
  int8  symmetric, one scale per (token, kv_head, group of `group_size` elements; 0: the head)
  int4  asymmetric (scale + minimum), two values a byte; keys per channel over the block's tokens
        (`key_scales="channel"`, KIVI) or per token groups ("token"); values per token groups.
`sink_tokens`: the first tokens of every sequence ("attention sinks") stay in `model_dtype`; they
live in sink blocks, a region of the pool whose blocks carry them after the quantized part.

Sliding-window attention (`sliding_window` W on `window_layers`; gpu_pool/window.py reads the
pattern from a model config or a flag): a windowed layer needs only the KV of the last W - 1
tokens before the resume point, ceil((W - 1) / block_size) blocks, while full layers need every
block. Each layer is an equal share of a block (every segment has the layer as its first axis), so
`full_bytes_per_block` + `window_bytes_per_block` = `bytes_per_block`; `conversation_bytes` counts
a cached conversation both ways. A windowed pool stores the two kinds apart (gpu_pool/base.py):
full parts and window parts, each laid out as a plain layout of its own layers (`full_part()`,
`window_part()`), so the copy and quantization codecs work on either unchanged.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from gpu_pool.errors import InvalidArgument
from gpu_pool.window import (
    check_window,
    format_window_layers,
    parse_window_layers,
    window_from_hf_config,
)

DTYPE_BITS: dict[str, int] = {"fp32": 32, "fp16": 16, "bf16": 16, "fp8": 8, "int8": 8, "int4": 4}
QUANTIZED = ("int8", "int4")
MODEL_DTYPES = ("fp32", "fp16", "bf16")
KEY_SCALES = ("channel", "token")
SCALE_BYTES = 2  # fp16 scales
SINK_TOKENS = 4  # the serve default for quantized pools

# Hugging Face `torch_dtype` / `dtype` strings -> our names.
_HF_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


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
        self._check_window()

    def _check_window(self) -> None:
        if self.sliding_window is None:
            if self.window_layers:
                raise InvalidArgument("KVLayout.window_layers without a sliding_window")
            return
        check_window(self.sliding_window)
        layers = self.window_layers
        if not isinstance(layers, tuple) or not layers:
            raise InvalidArgument(f"a sliding window needs a non-empty tuple of windowed layers, "
                                  f"got {layers!r}")
        for i in layers:
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.num_layers:
                raise InvalidArgument(f"window layer {i!r} is not one of the layers "
                                      f"0-{self.num_layers - 1}")
        if list(layers) != sorted(set(layers)):
            raise InvalidArgument(f"window layers must be increasing and distinct: {layers}")

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
    def window_pattern(self) -> str:
        """The windowed layers as a --window-layers spec ("all", "alternate", "5:1", "0-3,8");
        "" without a window."""
        if not self.window_layers:
            return ""
        return format_window_layers(self.window_layers, self.num_layers)

    @property
    def full_layers(self) -> tuple[int, ...]:
        """Indices of the full-attention layers."""
        windowed = set(self.window_layers)
        return tuple(i for i in range(self.num_layers) if i not in windowed)

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
        if self.sliding_window is None:
            return 0
        return -(-(self.sliding_window - 1) // self.block_size)

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
    def from_preset(cls, name: str, dtype: str | None = None, block_size: int = 16) -> KVLayout:
        try:
            base = PRESETS[name.lower()]
        except KeyError:
            raise InvalidArgument(
                f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}"
            ) from None
        lay = replace(base, block_size=block_size)
        return lay.with_dtype(dtype) if dtype else lay

    @classmethod
    def from_hf_config(
        cls, config: dict[str, Any] | str | Path, dtype: str | None = None, block_size: int = 16
    ) -> KVLayout:
        """Build from a Hugging Face `config.json` (a dict or a path). Uses num_hidden_layers,
        num_key_value_heads (default num_attention_heads: no GQA), and head_dim or
        hidden_size / num_attention_heads; dtype from torch_dtype unless given; the sliding
        window and its layers from sliding_window, layer_types and the like
        (gpu_pool.window.window_from_hf_config)."""
        if not isinstance(config, dict):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            try:
                config = json.loads(path.read_text())
            except FileNotFoundError:
                raise InvalidArgument(f"model config {str(path)!r} does not exist") from None
            except json.JSONDecodeError as e:
                raise InvalidArgument(f"model config {str(path)!r} is not JSON: {e}") from None
            if not isinstance(config, dict):
                raise InvalidArgument(f"model config {str(path)!r} is not a JSON object")
        cfg = config.get("text_config", config)  # multimodal configs nest the LM

        def need_int(key: str) -> int:
            if key not in cfg:
                raise InvalidArgument(f"model config has no {key!r}")
            value = cfg[key]
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidArgument(f"model config {key!r} must be a positive integer: {value!r}")
            return value

        num_layers = need_int("num_hidden_layers")
        num_heads = need_int("num_attention_heads")
        has_gqa = "num_key_value_heads" in cfg
        num_kv_heads = need_int("num_key_value_heads") if has_gqa else num_heads
        if cfg.get("head_dim") is not None:
            head_dim = need_int("head_dim")
        else:
            hidden = need_int("hidden_size")
            if hidden % num_heads:
                raise InvalidArgument(
                    f"model config hidden_size {hidden} is not divisible by "
                    f"num_attention_heads {num_heads}; give head_dim"
                )
            head_dim = hidden // num_heads
        if num_heads % num_kv_heads:
            raise InvalidArgument(
                f"model config num_attention_heads {num_heads} is not a multiple of "
                f"num_key_value_heads {num_kv_heads}"
            )
        hf_dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
        window, window_layers = window_from_hf_config(cfg, num_layers)
        lay = cls(num_layers, num_kv_heads, head_dim, _HF_DTYPES.get(str(hf_dtype), "bf16"),
                  block_size, sliding_window=window, window_layers=window_layers)
        return lay.with_dtype(dtype) if dtype else lay


# Published architectures (config.json of each model); kv_heads are the GQA counts.
PRESETS: dict[str, KVLayout] = {
    "llama-3.2-1b": KVLayout(num_layers=16, num_kv_heads=8, head_dim=64),
    "llama-3-8b": KVLayout(num_layers=32, num_kv_heads=8, head_dim=128),
    "llama-3-70b": KVLayout(num_layers=80, num_kv_heads=8, head_dim=128),
    "llama-3.1-405b": KVLayout(num_layers=126, num_kv_heads=8, head_dim=128),
    "mistral-7b": KVLayout(num_layers=32, num_kv_heads=8, head_dim=128),
    "qwen2.5-0.5b": KVLayout(num_layers=24, num_kv_heads=2, head_dim=64),
    "qwen2.5-7b": KVLayout(num_layers=28, num_kv_heads=4, head_dim=128),
    "qwen2.5-72b": KVLayout(num_layers=80, num_kv_heads=8, head_dim=128),
    # radixkv.engines.models "smollm2-135m": its Q4_1 weights run dequantized, so KV is fp32
    "smollm2-135m": KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="fp32"),
    # Sliding-window attention. Mistral-7B-v0.1: every layer windowed (v0.2 and later, the
    # "mistral-7b" preset, dropped the window).
    "mistral-7b-v0.1": KVLayout(num_layers=32, num_kv_heads=8, head_dim=128,
                                sliding_window=4096, window_layers=tuple(range(32))),
    # Gemma-3-12B's attention (48 layers, 8 KV heads, head_dim 256, window 1,024, every sixth
    # layer full: 40 windowed, 8 full). "-like": the other sizes differ in layers and heads (27B:
    # 62 layers, 16 x 128; 1B: 26 layers, 1 KV head, window 512).
    "gemma-3-like": KVLayout(num_layers=48, num_kv_heads=8, head_dim=256, sliding_window=1024,
                             window_layers=tuple(i for i in range(48) if i % 6 < 5)),
    # gpt-oss-20b's attention (24 layers, 8 KV heads, head_dim 64, window 128, even layers
    # windowed). "-like": gpt-oss-120b has 36 such layers; its learned per-head attention sinks
    # are weights, not cached tokens, so they cost no KV.
    "gpt-oss-like": KVLayout(num_layers=24, num_kv_heads=8, head_dim=64, sliding_window=128,
                             window_layers=tuple(range(0, 24, 2))),
}


_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
    "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """'80GiB' -> 85899345920, '1.5GB' -> 1500000000, '4096' -> 4096."""
    s = text.strip().lower().replace("_", "").replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    if unit not in _UNITS or not num:
        raise InvalidArgument(
            f"cannot read {text!r} as a size; use e.g. 80GiB, 512MiB, 1.5GB or a byte count"
        )
    try:
        value = float(num) * _UNITS[unit]
    except ValueError:
        raise InvalidArgument(f"cannot read {text!r} as a size") from None
    if value < 0:
        raise InvalidArgument(f"size must be >= 0, got {text!r}")
    return int(value)


_DEC = ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB"))
_BIN = ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))


def format_bytes(n: float) -> str:
    """Decimal and binary units side by side: '1.34 GB (1.25 GiB)'."""
    if n < 1000:
        return f"{int(n)} B"
    dscale, dunit = next(u for u in _DEC if n >= u[0])
    bscale, bunit = next((u for u in _BIN if n >= u[0]), _BIN[-1])
    return f"{n / dscale:.2f} {dunit} ({n / bscale:.2f} {bunit})"
