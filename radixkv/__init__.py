"""radixkv: a prefix KV-cache service for LLM inference engines.

Layers, bottom up (docs/architecture.md, "Code organization"): `kvpool` (KV layout, block
pool, copies), `radixkv.protocol` (what both sides of the wire agree on), `radixkv.client` (what
engines import; it loads nothing of the service side) and `radixkv.index` (the radix trees),
`radixkv.service` (the core, no gRPC), `radixkv.disk` (the tier below the pool), `radixkv.rpc`
(what the server and the cluster share), `radixkv.server`, `radixkv.cluster`, then the engine
side (`radixkv.integrations`, `radixkv.engines`) and the tools (`radixkv.replay`, `radixkv.cli`).
Importing the package imports nothing heavy: the KV layout is re-exported from `kvpool.layout`,
which is pure Python; grpc and torch come in only with the modules that need them."""

from kvpool.layout import PRESETS, KVLayout
from radixkv.protocol.errors import RadixKVError

__all__ = ["KVLayout", "PRESETS", "RadixKVError"]
__version__ = "0.1.0"
