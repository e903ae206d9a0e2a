"""Stand-in (see torchvision/__init__.py)."""

from __future__ import annotations

from typing import Any

from torchvision import Missing
from torchvision.transforms import functional
from torchvision.transforms.functional import InterpolationMode

__all__ = ["InterpolationMode", "functional"]


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return Missing(f"torchvision.transforms.{name}")
