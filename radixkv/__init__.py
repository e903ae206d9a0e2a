"""radixkv: a prefix KV-cache service for LLM inference engines.

The package imports nothing heavy at top level: `radixkv.layout` and `radixkv.tree` are pure
Python; the service, client and pool pull in grpc / torch only when imported."""

from radixkv.errors import RadixKVError
from radixkv.layout import PRESETS, KVLayout

__all__ = ["KVLayout", "PRESETS", "RadixKVError"]
__version__ = "0.1.0"
