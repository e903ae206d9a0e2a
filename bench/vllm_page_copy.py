"""Micro-benchmark: the vLLM connector's copies between radixkv pool blocks and vLLM's CPU
pages, against a memcpy of the same bytes, as CPU time of the calling thread (torch on one
thread, as the connector's loader runs).

One load or save is --pages blocks of SmolLM2-135M's geometry (30 layers, 3 KV heads, head dim
64, block 128: 41 MB in bf16), the page interior probed through vLLM's own cache-write op
(radixkv/integrations/layout.py). Paths: the native kernel (pages_kernel.py), vLLM's cache
write, strided views, the index gather and scatter; loads per layer as the loader calls them
(`per_layer`) and all layers in one call. Each round times every path once, back to back;
figures are medians over --repeat rounds. Needs the vLLM venv:

    .venv-vllm/bin/python bench/vllm_page_copy.py --dtype bf16 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--pages", type=int, default=14, help="blocks per load and save (14)")
    ap.add_argument("--repeat", type=int, default=7, help="rounds (7)")
    ap.add_argument("--json", action="store_true", help="print JSON only")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from radixkv.integrations import pages_kernel
    from radixkv.integrations.layout import ProbedPages

    h, b, d, n_layers, n = 3, 128, 64, 30, args.pages
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    isa = _get_attn_isa(dt, b, d)

    def write(k: torch.Tensor, v: torch.Tensor, page: torch.Tensor, slots: torch.Tensor) -> None:
        kc, vc = page.view(page.shape[0], h, 2 * b, d).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa, k_scale=1.0, v_scale=1.0,
                                       kv_cache_dtype="auto")

    pages = ProbedPages.probe(write, h, b, d, dt)
    store = torch.randn(n_layers, 4 * n, h, b, 2 * d).to(dt)  # vLLM: one storage
    layers = list(store.unbind(0))
    pool = torch.randn(3 * n, n_layers, 2, b, h, d).to(dt)
    at, blocks = list(range(1, 1 + 2 * n, 2)), list(range(n, 2 * n))
    size = n * n_layers * 2 * b * h * d * dt.itemsize
    src, dst = torch.empty(size, dtype=torch.uint8), torch.empty(size, dtype=torch.uint8)
    plain = replace(pages, kernel=False)

    def per_layer(way: ProbedPages) -> Callable[[], None]:
        return lambda: [way.from_pool([kv], at, pool[:, i:i + 1], blocks)
                        for i, kv in enumerate(layers)] and None

    paths: dict[str, Callable[[], Any]] = {
        "memcpy": lambda: dst.copy_(src),
        "load_kernel_per_layer": per_layer(pages),
        "load_kernel": lambda: pages.from_pool(layers, at, pool, blocks),
        "load_cache_write_per_layer": per_layer(plain),
        "load_strided": lambda: replace(plain, write=None).from_pool(layers, at, pool, blocks),
        "load_index": lambda: replace(plain, write=None, strided=None).from_pool(
            layers, at, pool, blocks),
        "save_kernel": lambda: pages.to_pool(layers, at, pool, blocks),
        "save_strided": lambda: plain.to_pool(layers, at, pool, blocks),
        "save_index": lambda: replace(plain, strided=None).to_pool(layers, at, pool, blocks),
    }
    times: dict[str, list[float]] = {name: [] for name in paths}
    for f in paths.values():
        f()  # warm: the kernel's build or load, first touches
    for _ in range(args.repeat):
        for name, f in paths.items():
            c = time.thread_time()
            f()
            times[name].append((time.thread_time() - c) * 1e3)
    ms = {name: round(statistics.median(t), 2) for name, t in times.items()}
    out = {"dtype": args.dtype, "isa": isa, "pages": n, "layers": n_layers, "mbytes":
           round(size / 1e6, 1), "kernel": pages_kernel.ops() is not None, "cpu_ms": ms,
           "vs_memcpy": {k: round(v / ms["memcpy"], 2) for k, v in ms.items()}}
    if args.json:
        print(json.dumps(out))
        return
    print(f"{out['mbytes']} MB per copy ({n} pages x {n_layers} layers, {args.dtype}, {isa}); "
          f"CPU ms (x memcpy), medians of {args.repeat}")
    for name, v in ms.items():
        print(f"  {name:28s} {v:7.2f}  x{out['vs_memcpy'][name]:.2f}")


if __name__ == "__main__":
    main()
