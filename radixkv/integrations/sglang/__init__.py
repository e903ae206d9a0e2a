"""radixkv as SGLang's HiCache storage backend: `RadixKVStore` (store.py: set-up and the v1
zero-copy calls; flat.py: the generic interface), over keys.py (page keys as key paths, the
namespace), slots.py (host slots as whole pages) and ends.py (how its leases end).

`"module_path": "radixkv.integrations.sglang", "class_name": "RadixKVStore"` names this package."""

from __future__ import annotations

from radixkv.integrations.sglang.store import RadixKVStore

__all__ = ["RadixKVStore"]
