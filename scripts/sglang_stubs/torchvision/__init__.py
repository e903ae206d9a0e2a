"""A stand-in for torchvision in .venv-sglang (scripts/bootstrap_sglang).

The registry's torchvision wheels are linked against CUDA torch and fail to import next to the
CPU torch==2.13.0 ("operator torchvision::nms does not exist"). SGLang and transformers import
torchvision at module level in their image and video code, which SGLang's config package pulls
in; the HiCache path (host pool, cache controller, storage backends) never calls it. Every name
here and in any submodule (torchvision.io, torchvision.transforms.v2, ...) resolves (to a
`Missing`), and calling one raises.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

STUB = True
__version__ = "0.0.0+radixkv.stub"


class Missing:
    """Any torchvision name: attributes resolve to more of these; a call raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, name: str) -> Missing:
        if name.startswith("__"):
            raise AttributeError(name)
        return Missing(f"{self._name}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name}: torchvision is a stand-in in this venv (CPU torch; "
                           "the registry's torchvision needs CUDA torch)")

    def __repr__(self) -> str:
        return f"<stand-in {self._name}>"


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return Missing(f"torchvision.{name}")


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """torchvision.* submodules that have no file here: modules of Missing names."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if not fullname.startswith(__name__ + "."):
            return None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    return spec
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = lambda name: _missing(spec.name, name)  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _missing(module: str, name: str) -> Missing:
    if name.startswith("__"):
        raise AttributeError(name)
    return Missing(f"{module}.{name}")


if not any(isinstance(f, _Submodules) for f in sys.meta_path):
    sys.meta_path.append(_Submodules())
