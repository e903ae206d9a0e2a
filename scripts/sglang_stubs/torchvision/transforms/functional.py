"""Stand-in (see torchvision/__init__.py)."""

from __future__ import annotations

import enum
from typing import Any

from torchvision import Missing


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return Missing(f"torchvision.transforms.functional.{name}")
