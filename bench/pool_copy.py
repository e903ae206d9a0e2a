"""Micro-benchmark: gather N random pool blocks into engine-layout K/V tensors and scatter them
back, against the copy floor measured in the same run (a torch copy_ of one contiguous tensor of
the same bytes, between the same two memories: pool slab <-> ordinary tensor).

Block sizes 16 KiB .. 4 MiB come from block_size tokens x a small layout (2 layers, 8 KV heads,
head_dim 128, fp16: 8 KiB per token; `--model-dtype fp32` doubles them). Timings are the best
of --repeat rounds, each round running floor, gather and scatter back to back (so noise from
other processes hits them alike).

Rounds repeat the same bytes, so a call of 16-32 MiB runs partly L3-hot (floor and copies
alike). `--cold` writes a 256 MiB buffer before every timed copy, so each starts from memory, as
an engine's copy of KV it has not touched lately does; random 16 KiB rows then cost gather and
scatter alike ~20 % against a sequential floor at 64 KiB blocks (DRAM locality), and nothing
from 256 KiB up.

Quantized pools (`--kv-dtypes int8,int4`, default both): rows with `kv_dtype` int8 / int4 time
`pool.read` (gather + dequantize into model-dtype K/V, preallocated as the plain gather's are)
and `pool.write` (quantize + scatter) of the same blocks, in model-dtype bytes per second, and
their ratios to the plain gather and scatter of the same run (`gather_vs_plain`,
`scatter_vs_plain`). On the CPU that is the fused kernel of kvpool/quant_kernel.cpp;
`RADIXKV_NO_KERNEL=1` times the torch ops instead.

    .venv/bin/python bench/pool_copy.py --device cpu --blocks 256 --repeat 15
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from kvpool import create_pool, gather, scatter
from kvpool.codecs import TORCH_DTYPES
from kvpool.layout import KVLayout

BLOCK_SIZES = [2, 8, 32, 128, 512]  # tokens: 16 KiB, 64 KiB, 256 KiB, 1 MiB, 4 MiB blocks
POOL_CAP = 1 << 30  # the pool holds up to 4 N blocks, at most 1 GiB
SCRATCH_BYTES = 256 << 20  # written before each timed copy: larger than any L3 / GPU L2


def make_layout(block_size: int, dtype: str = "fp16") -> KVLayout:
    return KVLayout(num_layers=2, num_kv_heads=8, head_dim=128, dtype=dtype, block_size=block_size)


def timer(device: str) -> Callable[[Callable[[], object]], float]:
    if device == "cuda":
        def timed(fn: Callable[[], object]) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end)) / 1e3

        return timed

    def timed_cpu(fn: Callable[[], object]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return timed_cpu


def best_times(device: str, ops: dict[str, Callable[[], object]], repeat: int,
               flush: Callable[[], object]) -> dict[str, float]:
    """Warm each op up, then the best of `repeat` rounds, the ops back to back in each."""
    timed = timer(device)
    for fn in ops.values():
        fn()
    best = {name: float("inf") for name in ops}
    for _ in range(repeat):
        for name, fn in ops.items():
            flush()
            best[name] = min(best[name], timed(fn))
    return best


def bench_size(
    device: str, block_size: int, n: int, repeat: int, rng: random.Random,
    flush: Callable[[], object], dtype: str = "fp16",
) -> dict[str, Any]:
    layout = make_layout(block_size, dtype)
    bpb = layout.bytes_per_block
    pool_blocks = max(n, min(4 * n, POOL_CAP // bpb))
    backend = "cuda" if device == "cuda" else "host"
    with create_pool(
        layout, num_blocks=pool_blocks, backend=backend, name_prefix="rkvbench"
    ) as pool:  # views still alive at close keep the memory until they go (see kvpool.base)
        view = pool.view()
        view.view(torch.uint8).fill_(7)  # fault every page in, not in the timed part
        ids_list = rng.sample(range(pool_blocks), n)
        ids = torch.tensor(ids_list, dtype=torch.int64, device=view.device)
        check = device != "cuda"  # the id check synchronizes on cuda
        k, v = gather(view, ids, check=check)
        nbytes = n * bpb
        slab = view.view(-1).view(torch.uint8)[:nbytes]  # same bytes, contiguous, in the pool
        flat = torch.empty(nbytes, dtype=torch.uint8, device=view.device)
        ops: dict[str, Callable[[], object]] = {
            "floor_in": lambda: flat.copy_(slab),  # pool -> tensor, as gather
            "gather": lambda: gather(view, ids, out=(k, v), check=check),
            "floor_out": lambda: slab.copy_(flat),  # tensor -> pool, as scatter
            "scatter": lambda: scatter(view, ids, k, v, check=check),
        }
        best = best_times(device, ops, repeat, flush)
        # correctness while we are here: what was scattered is what was gathered
        k2, v2 = gather(view, ids, check=check)
        assert torch.equal(k2.view(torch.uint8), k.view(torch.uint8))
    gbs = {name: nbytes / t / 1e9 for name, t in best.items()}
    return {
        "kv_dtype": layout.dtype,
        "model_dtype": layout.dtype,
        "block_bytes": bpb,
        "block_size": block_size,
        "blocks": n,
        "bytes": nbytes,
        **{f"{name}_gbs": round(x, 2) for name, x in gbs.items()},
        "gather_ratio": round(best["floor_in"] / best["gather"], 3),
        "scatter_ratio": round(best["floor_out"] / best["scatter"], 3),
        "gather_s": best["gather"],
        "scatter_s": best["scatter"],
    }


def bench_quantized(device: str, kv_dtype: str, plain: dict[str, Any], repeat: int,
                    rng: random.Random, flush: Callable[[], object]) -> dict[str, Any]:
    """pool.read / pool.write of `plain`'s blocks stored as `kv_dtype`, against `plain`."""
    model = make_layout(plain["block_size"], plain["model_dtype"])
    layout = model.with_dtype(kv_dtype, sink_tokens=0)
    n = plain["blocks"]
    backend = "cuda" if device == "cuda" else "host"
    with create_pool(layout, num_blocks=2 * n, backend=backend, name_prefix="rkvbench") as pool:
        pool.view().fill_(7)  # fault every page in, not in the timed part
        ids = rng.sample(range(2 * n), n)
        shape = (model.num_layers, n * model.block_size, model.num_kv_heads, model.head_dim)
        dtype = getattr(torch, TORCH_DTYPES[model.dtype])
        k = torch.randn(shape, dtype=dtype, device=pool.view().device)
        v = torch.randn_like(k)
        out = (torch.empty_like(k), torch.empty_like(v))
        ops: dict[str, Callable[[], object]] = {
            "gather": lambda: pool.read(ids, out=out), "scatter": lambda: pool.write(ids, k, v)}
        best = best_times(device, ops, repeat, flush)
    nbytes = plain["bytes"]  # the same K/V in the model dtype
    return {
        "kv_dtype": kv_dtype,
        "model_dtype": model.dtype,
        "block_bytes": layout.bytes_per_block,
        "block_size": model.block_size,
        "blocks": n,
        "bytes": nbytes,
        "gather_gbs": round(nbytes / best["gather"] / 1e9, 3),
        "scatter_gbs": round(nbytes / best["scatter"] / 1e9, 3),
        "gather_vs_plain": round(plain["gather_s"] / best["gather"], 3),
        "scatter_vs_plain": round(plain["scatter_s"] / best["scatter"], 3),
    }


def fmt_size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def main(argv: list[str] | None = None) -> int:
    # SIGTERM unwinds like an exception, so each pool's `with` unlinks its shared memory
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--blocks", type=int, default=256, help="blocks gathered per call")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=7, help="timed rounds (best is kept)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--cold", action="store_true",
                        help="flush caches before every timed copy (write a 256 MiB buffer)")
    parser.add_argument("--model-dtype", choices=("fp16", "bf16", "fp32"), default="fp16",
                        help="the plain pool's dtype, and the quantized pools' model dtype")
    parser.add_argument("--kv-dtypes", default="int8,int4",
                        help="quantized formats to time beside the plain copy ('' for none)")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch sees no GPU", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    flush: Callable[[], object] = (
        torch.empty(SCRATCH_BYTES, dtype=torch.uint8, device=args.device).zero_ if args.cold
        else (lambda: None))
    rows = [bench_size(args.device, bs, args.blocks, args.repeat, rng, flush, args.model_dtype)
            for bs in BLOCK_SIZES]
    big = [r for r in rows if r["block_bytes"] >= 64 << 10]
    worst = min(min(r["gather_ratio"], r["scatter_ratio"]) for r in big)
    quantized = [bench_quantized(args.device, kv, plain, args.repeat, rng, flush)
                 for plain in rows for kv in filter(None, args.kv_dtypes.split(","))]
    for r in rows:
        del r["gather_s"], r["scatter_s"]
    result = {
        "device": args.device,
        "threads": torch.get_num_threads(),
        "model_dtype": args.model_dtype,
        "blocks": args.blocks,
        "repeat": args.repeat,
        "seed": args.seed,
        "caches": "flushed" if args.cold else "warm",
        "rows": rows + quantized,
        "worst_ratio_ge_64k": worst,
        "worst_quantized_vs_plain": min(
            (min(r["gather_vs_plain"], r["scatter_vs_plain"]) for r in quantized), default=None),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"device {args.device}, {args.model_dtype}, {torch.get_num_threads()} torch threads, "
          f"{args.blocks} random blocks per call, best of {args.repeat}, caches "
          f"{result['caches']}")
    print(f"{'block':>8} {'floor in':>9} {'gather':>9} {'ratio':>6} {'floor out':>9} "
          f"{'scatter':>9} {'ratio':>6}   (GB/s)")
    for r in rows:
        print(f"{fmt_size(r['block_bytes']):>8} {r['floor_in_gbs']:9.2f} {r['gather_gbs']:9.2f} "
              f"{r['gather_ratio']:6.2f} {r['floor_out_gbs']:9.2f} {r['scatter_gbs']:9.2f} "
              f"{r['scatter_ratio']:6.2f}")
    print(f"pool_copy: worst gather/scatter ratio to the copy floor for blocks >= 64 KiB: "
          f"{worst:.2f} (goal 0.80)")
    if quantized:
        print(f"\nquantized (model-dtype {args.model_dtype} bytes/s), against the plain copy above")
        print(f"{'format':>7} {'block':>8} {'gather':>9} {'vs plain':>8} {'scatter':>9} "
              f"{'vs plain':>8}   (GB/s)")
        for r in quantized:
            print(f"{r['kv_dtype']:>7} {fmt_size(r['bytes'] // r['blocks']):>8} "
                  f"{r['gather_gbs']:9.3f} {r['gather_vs_plain']:8.3f} {r['scatter_gbs']:9.3f} "
                  f"{r['scatter_vs_plain']:8.3f}")
        print(f"pool_copy: worst quantized ratio to the plain copy: "
              f"{result['worst_quantized_vs_plain']:.2f} (goal 0.30)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
