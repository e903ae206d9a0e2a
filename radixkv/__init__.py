"""radixkv: a prefix KV-cache service for LLM inference engines.

Parts (README, "An engine's request"): `gpu_pool` (the lower layer: KV layout, block pool, copies),
`radixkv.index` (the radix tree), `radixkv.service` (the verbs; its parts `validation`,
`lease_table`, `kinds`, `namespaces`, `reclaim`), `radixkv.server` (gRPC), `radixkv.client` (what
engines import; with `lease`, `types`, `wire`, `env` it loads nothing of the service side),
`radixkv.cli`, `radixkv.replay`, `radixkv.engines`.
Importing the package imports nothing heavy: the KV layout is re-exported from `gpu_pool.layout`,
which is pure Python; grpc and torch come in only with the modules that need them."""

from gpu_pool.layout import PRESETS, KVLayout
from radixkv.errors import RadixKVError

__all__ = ["KVLayout", "PRESETS", "RadixKVError"]
__version__ = "0.1.0"
