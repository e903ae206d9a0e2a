"""Which layers of a model use sliding-window attention: from a Hugging Face config or a flag.

Hugging Face convention: a windowed layer with window W lets a query attend to itself and the
W - 1 tokens before it, so resuming a prompt at position p needs that layer's KV of positions
[max(0, p - W + 1), p) only; full-attention layers need all of [0, p).

Flag spec (`--window-layers`), over layer indices 0 .. num_layers - 1:
  all         every layer (Mistral-7B-v0.1)
  alternate   even layers windowed, odd layers full (Gemma-2, gpt-oss): the same as 1:1
  N:M         repeating N windowed then M full layers (Gemma-3: 5:1)
  0-3,8       a list of layer indices and inclusive ranges
A spec that names no layer is an error: give no window instead.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from gpu_pool.errors import InvalidArgument

SLIDING, FULL = "sliding_attention", "full_attention"  # HF `layer_types` values


def check_window(value: object, source: str = "sliding window") -> int:
    """A window size: a positive integer of tokens."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidArgument(f"{source} must be a positive number of tokens, got {value!r}")
    return value


def _every(num_layers: int, windowed: int, full: int) -> tuple[int, ...]:
    return tuple(i for i in range(num_layers) if i % (windowed + full) < windowed)


def parse_window_layers(spec: str, num_layers: int) -> tuple[int, ...]:
    """The windowed layer indices that `spec` names (see the module doc), sorted."""
    text = spec.strip().lower()
    if text == "all":
        layers: tuple[int, ...] = tuple(range(num_layers))
    elif text == "alternate":
        layers = _every(num_layers, 1, 1)
    elif m := re.fullmatch(r"(\d+):(\d+)", text):
        windowed, full = int(m[1]), int(m[2])
        if windowed + full == 0:
            raise InvalidArgument(f"window layer pattern {spec!r}: N:M needs N + M > 0")
        layers = _every(num_layers, windowed, full)
    else:
        picked: set[int] = set()
        for part in text.split(","):
            m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
            if not m:
                raise InvalidArgument(
                    f"cannot read window layer pattern {spec!r}; use all, alternate, N:M "
                    f"(N windowed then M full, repeating) or indices like 0-3,8")
            first, last = int(m[1]), int(m[2] or m[1])
            if first > last or last >= num_layers:
                raise InvalidArgument(f"window layer pattern {spec!r}: {part.strip()!r} is not "
                                      f"within layers 0-{num_layers - 1}")
            picked.update(range(first, last + 1))
        layers = tuple(sorted(picked))
    if not layers:
        raise InvalidArgument(f"window layer pattern {spec!r} names no layer of {num_layers}")
    return layers


def format_window_layers(layers: tuple[int, ...], num_layers: int) -> str:
    """A spec that `parse_window_layers` reads back as `layers`: all, a pattern that repeats at
    least twice (alternate, N:M), else indices."""
    if layers == tuple(range(num_layers)):
        return "all"
    for period in range(2, num_layers // 2 + 1):
        for windowed in range(1, period):
            if _every(num_layers, windowed, period - windowed) == layers:
                return "alternate" if period == 2 else f"{windowed}:{period - windowed}"
    runs: list[str] = []
    start = prev = layers[0]
    for i in (*layers[1:], None):
        if i is not None and i == prev + 1:
            prev = i
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(runs)


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
        layers = _every(num_layers, pattern - 1, 1)
    elif cfg.get("model_type") == "gemma2":
        layers = _every(num_layers, 1, 1)
    elif cfg.get("use_sliding_window") is True and "max_window_layers" in cfg:
        first = cfg["max_window_layers"]
        if not isinstance(first, int) or isinstance(first, bool) or first < 0:
            raise InvalidArgument(f"model config max_window_layers must be an integer >= 0, "
                                  f"got {first!r}")
        layers = tuple(range(first, num_layers))
    else:
        layers = tuple(range(num_layers))
    return (window, layers) if layers else (None, ())
