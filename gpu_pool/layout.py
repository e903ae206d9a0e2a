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
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from gpu_pool.errors import InvalidArgument

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
        return (memory_bytes // self.bytes_per_block) * self.block_size

    def blocks_in(self, memory_bytes: int) -> int:
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
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVLayout:
        fields = ("num_layers", "num_kv_heads", "head_dim", "dtype", "block_size", "model_dtype",
                  "group_size", "key_scales", "sink_tokens")
        return cls(**{k: data[k] for k in fields if k in data})

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
        hidden_size / num_attention_heads; dtype from torch_dtype unless given."""
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
        lay = cls(num_layers, num_kv_heads, head_dim, _HF_DTYPES.get(str(hf_dtype), "bf16"),
                  block_size)
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
