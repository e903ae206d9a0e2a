"""The timed part of bench/hicache_bench.py, run by .venv-sglang's python: SGLang's real
HiCacheController on CPU (tests/_sglang_harness.py) with one storage backend, backing up and
prefetching batches of pages; prints one JSON object of per-batch times.

    _hicache_worker.py BACKEND LAYOUT GEOMETRY_JSON BATCH ROUNDS [SOCKET]

BACKEND: radixkv or file (SGLang's own; SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR says where).
Each round backs up BATCH fresh pages (write_storage -> the backend's set) and prefetches them
(prefetch -> exists -> get); the first round warms up and is not counted. Also times a plain
copy of the same bytes between two host tensors (memcpy)."""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import _sglang_harness as h  # noqa: E402
import torch  # noqa: E402


def main() -> None:
    backend, layout, geometry, batch, rounds = sys.argv[1:6]
    socket = sys.argv[6] if len(sys.argv) > 6 else None
    g = h.Geometry(**{k: getattr(torch, v) if k == "dtype" else v
                      for k, v in json.loads(geometry).items()})
    h.set_rank()
    n = int(batch)
    extra: dict[str, object] = {}
    name = backend
    if backend == "radixkv":
        extra = {"backend_name": "radixkv", "module_path": "radixkv.integrations.sglang",
                 "class_name": "RadixKVStore", "interface_v1": 1, "socket": socket,
                 "hicache_storage_pass_prefix_keys": True}
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
    print(json.dumps({"set_s": sets, "get_s": gets, "memcpy_s": copies,
                      "page_bytes": page_bytes}))


if __name__ == "__main__":
    main()
