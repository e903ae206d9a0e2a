"""Sliding-window attention as a value (`SlidingWindow`: the window, its layers) and the
`--window-layers` spec that names the layers (a Hugging Face config's fields: kvpool/models.py).

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
from dataclasses import dataclass

from kvpool.errors import InvalidArgument


def check_window(value: object, source: str = "sliding window") -> int:
    """A window size: a positive integer of tokens."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidArgument(f"{source} must be a positive number of tokens, got {value!r}")
    return value


def every(num_layers: int, windowed: int, full: int) -> tuple[int, ...]:
    """The layers of a repeating pattern: `windowed` windowed layers, then `full` full ones."""
    return tuple(i for i in range(num_layers) if i % (windowed + full) < windowed)


def parse_window_layers(spec: str, num_layers: int) -> tuple[int, ...]:
    """The windowed layer indices that `spec` names (see the module doc), sorted."""
    text = spec.strip().lower()
    if text == "all":
        layers: tuple[int, ...] = tuple(range(num_layers))
    elif text == "alternate":
        layers = every(num_layers, 1, 1)
    elif m := re.fullmatch(r"(\d+):(\d+)", text):
        windowed, full = int(m[1]), int(m[2])
        if windowed + full == 0:
            raise InvalidArgument(f"window layer pattern {spec!r}: N:M needs N + M > 0")
        layers = every(num_layers, windowed, full)
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
            if every(num_layers, windowed, period - windowed) == layers:
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


@dataclass(frozen=True, slots=True)
class SlidingWindow:
    """The attention pattern of a model with sliding-window layers: `size` tokens W on `layers`
    (indices, increasing) of `num_layers`; the other layers attend to the whole prefix.
    `KVLayout.window` gives it for a windowed layout."""

    size: int
    layers: tuple[int, ...]
    num_layers: int

    def __post_init__(self) -> None:
        check_window(self.size)
        layers = self.layers
        if not isinstance(layers, tuple) or not layers:
            raise InvalidArgument(f"a sliding window needs a non-empty tuple of windowed layers, "
                                  f"got {layers!r}")
        for i in layers:
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.num_layers:
                raise InvalidArgument(f"window layer {i!r} is not one of the layers "
                                      f"0-{self.num_layers - 1}")
        if list(layers) != sorted(set(layers)):
            raise InvalidArgument(f"window layers must be increasing and distinct: {layers}")

    @property
    def pattern(self) -> str:
        """The windowed layers as a --window-layers spec ("all", "alternate", "5:1", "0-3,8")."""
        return format_window_layers(self.layers, self.num_layers)

    @property
    def full_layers(self) -> tuple[int, ...]:
        """Indices of the full-attention layers."""
        windowed = set(self.layers)
        return tuple(i for i in range(self.num_layers) if i not in windowed)

    def blocks(self, block_size: int) -> int:
        """Blocks a windowed layer keeps behind a block-aligned resume point p: positions
        [p - W + 1, p), ceil((W - 1) / block_size) blocks."""
        return -(-(self.size - 1) // block_size)
