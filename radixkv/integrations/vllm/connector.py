"""radixkv as vLLM's KV store: a KV connector (vLLM V1, `KVConnectorBase_V1`).

    --kv-transfer-config '{"kv_connector": "RadixKVConnector",
        "kv_connector_module_path": "radixkv.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"socket": "/path/radixkv.sock"}}'

Many vLLM processes share prefixes through one radixkv (one radix tree, one pool): a request
loads the longest cached prefix of whole blocks another instance stored, and at its end stores
its prompt and answer (`scheduler`, `worker`; pages <-> radixkv blocks: `integrations.layout`).
radixkv's block size must equal vLLM's (`--block-size`, 128 on CPU by default), its layout the
model's; at start the connector checks and refuses with the `radixkv serve` flags that fit.

Extra config: `socket` (default $RADIXKV_SOCKET, else the per-user socket), `namespace`
(default: model path@revision/dtype; a request's cache_salt and LoRA name are appended),
`lease_ttl` (seconds, 0: the server's), `lookup` ("table", the default: the scheduler reads
cached prefixes from radixkv's lookup table in shared memory and the worker pins them;
"match": the scheduler asks with a Match, as where radixkv publishes no table), `timeout`
(per call, default 5 s), `retry_s` (how soon an unreachable radixkv is tried again, default
1 s), `stats_file` (JSON lines of the
connector's own costs), `layerwise` (default true: CPU loads are copied layer by layer beside
the forward, `loader`), `load_cpus` (the loader thread's CPUs: "auto", the ones the
engine's thread is not bound to; "engine"; or a list such as "1,3-4"). radixkv absent at start,
killed or restarted: a logged warning and cache misses, never a failed request;
"kv_load_failure_policy": "recompute" makes vLLM recompute blocks whose load failed (the
default, "fail", ends such a request with an error).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from radixkv.integrations.link import Link
from radixkv.integrations.vllm.messages import Load, Save
from radixkv.integrations.vllm.scheduler import (
    SchedulerSide,
    base_namespace,
    check_layout,
    engine_layout,
    serve_flags,
)
from radixkv.integrations.vllm.stats import Stats
from radixkv.integrations.vllm.worker import WorkerSide

if TYPE_CHECKING:
    import torch

log = logging.getLogger("vllm.radixkv")  # under vLLM's logger: its format and level


def _flag(value: Any) -> bool:
    """A config flag given as a JSON bool or a string ("false", "0", "no": False)."""
    if isinstance(value, str):
        return value.strip().lower() not in ("false", "0", "no", "off", "")
    return bool(value)


class RadixKVMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's work for the worker: loads before the forward, saves after it."""

    def __init__(self, loads: list[Load], saves: list[Save]) -> None:
        self.loads = loads
        self.saves = saves


class RadixKVConnector(KVConnectorBase_V1):  # type: ignore[misc]
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        layout = engine_layout(vllm_config)
        flags = serve_flags(vllm_config, layout)
        self._stats = stats = Stats(extra.get("stats_file"), log)
        is_scheduler = role == KVConnectorRole.SCHEDULER
        self._link = Link(
            extra.get("socket"), f"vllm-{self._kv_transfer_config.engine_id}",
            check=lambda client: check_layout(client, layout, flags),
            timeout=float(extra.get("timeout", 5.0)), retry_s=float(extra.get("retry_s", 1.0)),
            what="vLLM scheduler" if is_scheduler else "vLLM worker", logger=log)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if is_scheduler:
            self._scheduler = SchedulerSide(
                self._link, base_namespace(vllm_config, extra.get("namespace")),
                layout.block_size, float(extra.get("lease_ttl", 0.0)), stats,
                use_table=str(extra.get("lookup", "table")) != "match")
        else:
            self._worker = WorkerSide(self._link, vllm_config, layout.num_kv_heads,
                                      layout.head_dim, layout.block_size, stats,
                                      layerwise=_flag(extra.get("layerwise", True)),
                                      load_cpus=str(extra.get("load_cpus", "auto")))
        if self._link.start():  # LayoutMismatch (refusal) propagates: vLLM does not start
            log.info("radixkv connector (%s) at %s: pool layout fits (%s)",
                     "scheduler" if is_scheduler else "worker",
                     extra.get("socket") or "the default socket", flags)

    # ---- worker side -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def _meta(self) -> RadixKVMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, RadixKVMetadata) else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._meta()
        if meta is not None and meta.loads and self._worker is not None:
            self._worker.start_loads(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # saves are whole-request, after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        if self._worker is None:
            return
        self._worker.finish_loads()
        meta = self._meta()
        if meta is not None and meta.saves:
            self._worker.save(meta.saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, None]:
        if self._worker is None:
            return None, None
        return self._worker.take_sent() or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_failed() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        self._link.close()
        self._stats.close()

    # ---- scheduler side ----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.matched(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        assert self._scheduler is not None
        ids = blocks.get_block_ids()[0] if num_external_tokens else []
        self._scheduler.after_alloc(request, ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> RadixKVMetadata:
        assert self._scheduler is not None
        loads, saves = self._scheduler.take()
        return RadixKVMetadata(loads, saves)

    def request_finished(self, request: Any,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.finished(request, block_ids), None

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a future miss


__all__ = ["RadixKVConnector", "RadixKVMetadata"]
