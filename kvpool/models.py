"""Model architectures: the KV geometry of a published model (`PRESET_MODELS`) or of a Hugging
Face `config.json` (`geometry_from_hf_config`), as a `ModelGeometry` that `KVLayout` is built
from (`KVLayout.from_preset`, `KVLayout.from_hf_config`). Knows no block size and no pool."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.errors import InvalidArgument
from kvpool.window import check_window, every

SLIDING, FULL = "sliding_attention", "full_attention"  # HF `layer_types` values

# Hugging Face `torch_dtype` / `dtype` strings -> our names.
HF_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


@dataclass(frozen=True, slots=True)
class ModelGeometry:
    """What a model's KV looks like per token: layers x kv_heads x head_dim in `dtype`, and its
    sliding window (None: full attention on every layer) on `window_layers`."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bf16"
    sliding_window: int | None = None
    window_layers: tuple[int, ...] = ()


# Published architectures (config.json of each model); kv_heads are the GQA counts.
PRESET_MODELS: dict[str, ModelGeometry] = {
    "llama-3.2-1b": ModelGeometry(num_layers=16, num_kv_heads=8, head_dim=64),
    "llama-3-8b": ModelGeometry(num_layers=32, num_kv_heads=8, head_dim=128),
    "llama-3-70b": ModelGeometry(num_layers=80, num_kv_heads=8, head_dim=128),
    "llama-3.1-405b": ModelGeometry(num_layers=126, num_kv_heads=8, head_dim=128),
    "mistral-7b": ModelGeometry(num_layers=32, num_kv_heads=8, head_dim=128),
    "qwen2.5-0.5b": ModelGeometry(num_layers=24, num_kv_heads=2, head_dim=64),
    "qwen2.5-7b": ModelGeometry(num_layers=28, num_kv_heads=4, head_dim=128),
    "qwen2.5-72b": ModelGeometry(num_layers=80, num_kv_heads=8, head_dim=128),
    # radixkv.engines.models "smollm2-135m": its Q4_1 weights run dequantized, so KV is fp32
    "smollm2-135m": ModelGeometry(num_layers=30, num_kv_heads=3, head_dim=64, dtype="fp32"),
    # Sliding-window attention. Mistral-7B-v0.1: every layer windowed (v0.2 and later, the
    # "mistral-7b" preset, dropped the window).
    "mistral-7b-v0.1": ModelGeometry(num_layers=32, num_kv_heads=8, head_dim=128,
                                     sliding_window=4096, window_layers=tuple(range(32))),
    # Gemma-3-12B's attention (48 layers, 8 KV heads, head_dim 256, window 1,024, every sixth
    # layer full: 40 windowed, 8 full). "-like": the other sizes differ in layers and heads (27B:
    # 62 layers, 16 x 128; 1B: 26 layers, 1 KV head, window 512).
    "gemma-3-like": ModelGeometry(num_layers=48, num_kv_heads=8, head_dim=256,
                                  sliding_window=1024,
                                  window_layers=tuple(i for i in range(48) if i % 6 < 5)),
    # gpt-oss-20b's attention (24 layers, 8 KV heads, head_dim 64, window 128, even layers
    # windowed). "-like": gpt-oss-120b has 36 such layers; its learned per-head attention sinks
    # are weights, not cached tokens, so they cost no KV.
    "gpt-oss-like": ModelGeometry(num_layers=24, num_kv_heads=8, head_dim=64, sliding_window=128,
                                  window_layers=tuple(range(0, 24, 2))),
}


def read_hf_config(config: Mapping[str, Any] | str | Path) -> Mapping[str, Any]:
    """A `config.json` as a mapping: `config` itself, or the file at a path (a directory: its
    config.json). InvalidArgument when it is missing or not a JSON object."""
    if isinstance(config, Mapping):
        return config
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise InvalidArgument(f"model config {str(path)!r} does not exist") from None
    except json.JSONDecodeError as e:
        raise InvalidArgument(f"model config {str(path)!r} is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise InvalidArgument(f"model config {str(path)!r} is not a JSON object")
    return data


def geometry_from_hf_config(config: Mapping[str, Any] | str | Path) -> ModelGeometry:
    """The KV geometry of a Hugging Face `config.json` (a mapping or a path). Uses
    num_hidden_layers, num_key_value_heads (default num_attention_heads: no GQA), and head_dim
    or hidden_size / num_attention_heads; the dtype from torch_dtype (bf16 when absent or not
    a float type); the sliding window and its layers from `window_from_hf_config`."""
    full = read_hf_config(config)
    cfg = full.get("text_config", full)  # multimodal configs nest the LM

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
    return ModelGeometry(num_layers, num_kv_heads, head_dim,
                         HF_DTYPES.get(str(hf_dtype), "bf16"), window, window_layers)


def window_from_hf_config(cfg: Mapping[str, Any],
                          num_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(window, windowed layer indices) of a Hugging Face text config; (None, ()) for full
    attention everywhere. In order:
      use_sliding_window false (Qwen2/3)    -> full attention, whatever sliding_window says
      layer_types (Gemma-2/3, gpt-oss, ...)  -> the layers marked sliding_attention
      sliding_window null or absent          -> full attention (Mistral v0.2 and later)
      sliding_window_pattern P (Gemma-3)     -> layer i windowed unless (i + 1) % P == 0
      model_type gemma2                      -> even layers windowed
      use_sliding_window true (Qwen2)        -> layers from max_window_layers on windowed
      otherwise (Mistral-7B-v0.1)            -> every layer windowed
    """
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False:
        return None, ()
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            raise InvalidArgument(f"model config layer_types must list {num_layers} layer "
                                  f"types (num_hidden_layers), got {types!r:.80}")
        unknown = sorted({str(t) for t in types} - {SLIDING, FULL})
        if unknown:
            raise InvalidArgument(f"model config layer_types has {', '.join(unknown)}: only "
                                  f"{SLIDING} and {FULL} are supported")
        layers = tuple(i for i, t in enumerate(types) if t == SLIDING)
        if not layers:
            return None, ()
        if window is None:
            raise InvalidArgument(f"model config layer_types names {len(layers)} "
                                  f"{SLIDING} layers but sliding_window is null")
        return check_window(window, "model config sliding_window"), layers
    if window is None:
        return None, ()
    window = check_window(window, "model config sliding_window")
    pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern"))
    if pattern is not None:
        if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern <= 0:
            raise InvalidArgument(f"model config sliding_window_pattern must be a positive "
                                  f"integer, got {pattern!r}")
        layers = every(num_layers, pattern - 1, 1)
    elif cfg.get("model_type") == "gemma2":
        layers = every(num_layers, 1, 1)
    elif cfg.get("use_sliding_window") is True and "max_window_layers" in cfg:
        first = cfg["max_window_layers"]
        if not isinstance(first, int) or isinstance(first, bool) or first < 0:
            raise InvalidArgument(f"model config max_window_layers must be an integer >= 0, "
                                  f"got {first!r}")
        layers = tuple(range(first, num_layers))
    else:
        layers = tuple(range(num_layers))
    return (window, layers) if layers else (None, ())
