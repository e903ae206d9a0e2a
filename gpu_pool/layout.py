"""The geometry of one model's KV cache and the memory calculator. Allocates nothing.

KV bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element.
LLaMA-3-70B (80 layers, 8 KV heads, head_dim 128, bf16): 2 x 80 x 8 x 128 x 2 = 327,680 B/token.

Quantized dtypes also store scales, and the calculator counts them:
  int8  one fp16 scale per (token, kv_head) for K and for V   (x_q = round(x / max|x| * 127))
  int4  one fp16 scale per group of `INT4_GROUP` elements, K and V apart; the first
        `SINK_TOKENS` tokens of a context ("attention sinks") stay at full precision.
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
SCALE_BYTES = 2  # fp16 scales
INT4_GROUP = 64
SINK_TOKENS = 4

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

    @property
    def elements_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @property
    def data_bytes_per_token(self) -> int:
        """K and V values only, without quantization scales."""
        return self.elements_per_token * DTYPE_BITS[self.dtype] // 8

    @property
    def scale_bytes_per_token(self) -> int:
        """Bytes of quantization scales per token (0 for fp32/fp16/bf16/fp8)."""
        heads = 2 * self.num_layers * self.num_kv_heads
        if self.dtype == "int8":
            return heads * SCALE_BYTES
        if self.dtype == "int4":
            return heads * math.ceil(self.head_dim / INT4_GROUP) * SCALE_BYTES
        return 0

    @property
    def bytes_per_token(self) -> int:
        """What one cached token costs: values plus their scales."""
        return self.data_bytes_per_token + self.scale_bytes_per_token

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block in elements: (layers, 2, block_size, kv_heads, head_dim)."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def is_quantized(self) -> bool:
        return self.dtype in QUANTIZED

    def context_bytes(self, num_tokens: int) -> int:
        """KV bytes for one context of `num_tokens` tokens. For int4, the first SINK_TOKENS
        tokens are kept at bf16 (the attention-sink exception)."""
        if num_tokens < 0:
            raise InvalidArgument(f"num_tokens must be >= 0, got {num_tokens}")
        if self.dtype != "int4":
            return num_tokens * self.bytes_per_token
        sinks = min(num_tokens, SINK_TOKENS)
        full = replace(self, dtype="bf16").bytes_per_token
        return sinks * full + (num_tokens - sinks) * self.bytes_per_token

    def tokens_in(self, memory_bytes: int) -> int:
        """How many tokens (whole blocks) fit in `memory_bytes` of pool."""
        return (memory_bytes // self.bytes_per_block) * self.block_size

    def blocks_in(self, memory_bytes: int) -> int:
        return memory_bytes // self.bytes_per_block

    def with_dtype(self, dtype: str) -> KVLayout:
        return replace(self, dtype=dtype)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVLayout:
        fields = ("num_layers", "num_kv_heads", "head_dim", "dtype", "block_size")
        return cls(**{k: data[k] for k in fields if k in data})

    @classmethod
    def from_preset(cls, name: str, dtype: str | None = None, block_size: int = 16) -> KVLayout:
        try:
            base = PRESETS[name.lower()]
        except KeyError:
            raise InvalidArgument(
                f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}"
            ) from None
        return replace(base, dtype=dtype or base.dtype, block_size=block_size)

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
        if dtype is None:
            hf_dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
            dtype = _HF_DTYPES.get(str(hf_dtype), "bf16")
        return cls(num_layers, num_kv_heads, head_dim, dtype, block_size)


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
