"""The timed part of bench/hicache_bench.py, run by .venv-sglang's python: SGLang's real
HiCacheController on CPU (tests/integrations/sglang/_sglang_harness.py) with one storage
backend, backing up and prefetching batches of pages; prints one JSON object of per-batch times.

    _hicache_worker.py BACKEND LAYOUT GEOMETRY_JSON BATCH ROUNDS [SOCKET]

With RADIXKV_BENCH_PROFILE=1 (radixkv only) the answer also has "profile": per kind of call
(each RPC, the copies, the three backend methods), the calls per timed batch and their median
milliseconds.
BACKEND: radixkv, file (SGLang's own; SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR says where) or
ceiling (no IPC at all: pages kept in this process, bench/_hicache_ceiling.py).
Each round backs up BATCH fresh pages (write_storage -> the backend's set) and prefetches them
(prefetch -> exists -> get); the first round warms up and is not counted. Also times a plain
copy of the same bytes between two host tensors (memcpy)."""

from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "integrations", "sglang"))

import _sglang_harness as h  # noqa: E402
import torch  # noqa: E402

TIMES: dict[str, list[float]] = collections.defaultdict(list)
_lock = threading.Lock()


def timed(owner: Any, name: str, label: str) -> None:
    """Record each call of owner.name under `label` (SGLang's threads call them)."""
    inner: Callable[..., Any] = getattr(owner, name)

    def call(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            with _lock:
                TIMES[label if label else f"rpc {args[1]}"].append(time.perf_counter() - t0)

    setattr(owner, name, call)


def profile() -> None:
    from radixkv.client import Client
    from radixkv.integrations.layout import HostPages
    from radixkv.integrations.sglang import RadixKVStore

    timed(Client, "_call", "")
    timed(HostPages, "copy", "copy")
    for method in ("batch_exists", "batch_get_v1", "batch_set_v1"):
        timed(RadixKVStore, method, method)


def main() -> None:
    backend, layout, geometry, batch, rounds = sys.argv[1:6]
    socket = sys.argv[6] if len(sys.argv) > 6 else None
    g = h.Geometry(**{k: getattr(torch, v) if k == "dtype" else v
                      for k, v in json.loads(geometry).items()})
    h.set_rank()
    n = int(batch)
    extra: dict[str, object] = {}
    name = backend
    profiling = backend == "radixkv" and os.environ.get("RADIXKV_BENCH_PROFILE") == "1"
    if profiling:
        profile()
    if backend in ("ceiling", "controller"):  # no IPC (bench/_hicache_ceiling.py); the
        # controller's own floor copies nothing at all
        extra = {"backend_name": backend, "module_path": "_hicache_ceiling",
                 "class_name": "CeilingStore", "interface_v1": 1,
                 "blocks": n * (int(rounds) + 1) + 8, "copy": backend == "ceiling"}
        name = "dynamic"
    if backend == "radixkv":
        extra = {"backend_name": "radixkv", "module_path": "radixkv.integrations.sglang",
                 "class_name": "RadixKVStore", "interface_v1": 1, "socket": socket,
                 "hicache_storage_pass_prefix_keys": True,
                 "lookup": os.environ.get("RADIXKV_BENCH_LOOKUP", "table")}
        name = "dynamic"
    cc = h.controller(g, layout, name, extra)
    host = cc.mem_pool_host
    slots = host.alloc(n * g.page_size)
    h.fill(cc, slots, 1)
    sets, gets = [], []
    for r in range(int(rounds) + 1):
        tokens = list(range(r * 10_000_000, r * 10_000_000 + n * g.page_size))
        t0 = time.perf_counter()
        stored = h.write(cc, slots, tokens, [])
        t1 = time.perf_counter()
        hit, loaded, got = h.prefetch(cc, f"r{r}", tokens)
        t2 = time.perf_counter()
        if stored != len(tokens) or loaded != len(tokens):
            raise SystemExit(f"{backend}: stored {stored}, loaded {loaded} of {len(tokens)}")
        if got is not None:
            host.free(got)
        if r:
            sets.append(t1 - t0)
            gets.append(t2 - t1)
        else:
            TIMES.clear()  # the warm-up is not profiled
    src = torch.empty(n * host.get_dummy_flat_data_page().numel(), dtype=g.dtype)
    src.normal_()
    dst = torch.empty_like(src)
    copies = []
    for r in range(int(rounds) + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        if r:
            copies.append(time.perf_counter() - t0)
    page_bytes = host.get_dummy_flat_data_page().numel() * host.dtype.itemsize
    out: dict[str, Any] = {"set_s": sets, "get_s": gets, "memcpy_s": copies,
                           "page_bytes": page_bytes}
    if profiling:
        out["profile"] = {k: {"per_batch": round(len(v) / int(rounds), 2),
                              "median_ms": round(sorted(v)[len(v) // 2] * 1e3, 3)}
                          for k, v in sorted(TIMES.items())}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
