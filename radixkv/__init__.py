"""radixkv: a prefix KV-cache service for LLM inference engines.

The package imports nothing heavy at top level: `gpu_pool.layout` and `radixkv.index.tree` are pure
Python; the service, client and pool pull in grpc / torch only when imported."""

from gpu_pool.layout import PRESETS, KVLayout
from radixkv.errors import RadixKVError

__all__ = ["KVLayout", "PRESETS", "RadixKVError"]
__version__ = "0.1.0"
