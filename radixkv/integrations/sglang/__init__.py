"""radixkv as SGLang's HiCache storage backend: `RadixKVStore` (store.py: set-up and the v1
zero-copy calls; flat.py: the generic interface), over keys.py (page keys as key paths, the
namespace), slots.py (host slots as whole pages) and ends.py (how its leases end).

`"module_path": "radixkv.integrations.sglang", "class_name": "RadixKVStore"` names this package:
the store is imported on first access, so the modules that need no SGLang import without it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixkv.integrations.sglang.store import RadixKVStore

__all__ = ["RadixKVStore"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from radixkv.integrations.sglang import store

        return getattr(store, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
