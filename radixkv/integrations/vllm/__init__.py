"""radixkv as vLLM's KV connector: `RadixKVConnector` (connector.py) over the scheduler side
(scheduler.py) and the worker side (worker.py, loader.py), which share only messages.py and
stats.py; driver.py runs a vLLM engine in a process of its own for tests and benchmarks.

`"kv_connector_module_path": "radixkv.integrations.vllm"` names this package: the connector is
imported on first access, so the modules that need no vLLM (the driver's parent side, the two
sides as tests drive them) import without it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixkv.integrations.vllm.connector import RadixKVConnector, RadixKVMetadata

__all__ = ["RadixKVConnector", "RadixKVMetadata"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from radixkv.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
