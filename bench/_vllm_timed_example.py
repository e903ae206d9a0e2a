"""vLLM's ExampleConnector (disk), timed: bench/vllm_ttft.py's engine E runs it so that what the
connector itself costs on the way to the first token is measured apart from the prefill, as
radixkv's connector's own cost is. Its behaviour is ExampleConnector's, unchanged.

Loaded by vLLM from `kv_connector_module_path` "bench._vllm_timed_example" (the engines run with
the repository on PYTHONPATH); `stats_file` in kv_connector_extra_config gets JSON lines:

    {"op": "match", "s": ...}                  the scheduler's lookup (a hash and a stat)
    {"op": "step", "load_s": ..., "save_s": ...}  a forward step that loaded or stored: the
                                               files read into vLLM's pages before the forward,
                                               and every layer's KV written to files during it
"""

from __future__ import annotations

import json
import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector


class TimedExampleConnector(ExampleConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stats_file = self._kv_transfer_config.get_from_extra_config("stats_file", None)
        self._load_s = self._save_s = 0.0

    def _record(self, **fields: Any) -> None:
        if self._stats_file:
            with open(self._stats_file, "a") as f:
                f.write(json.dumps(fields) + "\n")

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        t0 = time.perf_counter()
        try:
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        finally:
            self._record(op="match", s=time.perf_counter() - t0)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        t0 = time.perf_counter()
        super().start_load_kv(forward_context, **kwargs)
        self._load_s += time.perf_counter() - t0

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        t0 = time.perf_counter()
        super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
        self._save_s += time.perf_counter() - t0

    def wait_for_save(self) -> None:
        """The end of a forward step: one line for a step that loaded or stored anything."""
        super().wait_for_save()
        if self._get_connector_metadata().requests:  # type: ignore[attr-defined]
            self._record(op="step", load_s=self._load_s, save_s=self._save_s)
        self._load_s = self._save_s = 0.0
