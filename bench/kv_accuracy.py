"""Perplexity with KV read from the radixkv pool vs the model alone (SmolLM2-135M, pydoc corpus).

    python bench/kv_accuracy.py [--kv-dtypes fp32] [--contexts 512,2048,8192] [--json]

For each kv dtype, starts `radixkv serve` (host pool, the model's layout in that dtype) on a
temporary socket; a spawned engine process writes the first half of every window's KV into the
pool and this process reads it back to score the second half (radixkv/engines/evaluate.py).
Each context covers the corpus's first 8,192 tokens (16 windows of 512, 4 of 2,048, 1 of 8,192)
unless --windows says otherwise. One row per (kv dtype, context): ppl_reference (the model
computing the whole window), ppl_pool, delta_ppl_pct, max_abs_logit_diff. With fp32 KV the two
agree to float rounding. Progress goes to stderr; the default run takes a few minutes on 2 cores
(the 8,192-token window alone about a minute).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from typing import Any

from _common import emit, radixkv_server


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from radixkv.engines import evaluate, models

    contexts = [int(c) for c in args.contexts.split(",")]
    kv_dtypes = args.kv_dtypes.split(",")
    for kv_dtype in kv_dtypes:
        evaluate.check_kv_dtype(kv_dtype)
    loaded = models.load(args.model, notify=lambda m: print(m, file=sys.stderr))
    if loaded.tokenizer is None:
        raise SystemExit(f"--model {args.model} has no tokenizer: the corpus needs one")
    cached = max(evaluate.cached_length(c, args.block_size, args.cached_fraction)
                 for c in contexts)
    num_blocks = cached // args.block_size + 8  # one window's cached part; LRU drops the rest
    rows: list[dict[str, Any]] = []
    for kv_dtype in kv_dtypes:
        with tempfile.TemporaryDirectory(prefix="rkv-acc-") as directory:
            flags = [*loaded.serve_flags(directory), "--dtype", kv_dtype,
                     "--block-size", str(args.block_size), "--num-blocks", str(num_blocks)]
            with radixkv_server(directory, *flags) as sock:
                for row in evaluate.run_accuracy(
                        sock, loaded, kv_dtype, contexts, args.windows, args.cached_fraction,
                        progress=lambda m: print(m, file=sys.stderr, flush=True)):
                    rows.append(row.to_dict())
                    print(f"{kv_dtype} context {row.context}: ppl {row.ppl_reference:.4f} -> "
                          f"{row.ppl_pool:.4f} ({row.delta_ppl_pct:+.2e} %), max |dlogit| "
                          f"{row.max_abs_logit_diff:.2e}", file=sys.stderr, flush=True)
    return {"model": args.model, "corpus": "pydoc_data.topics", "block_size": args.block_size,
            "cached_fraction": args.cached_fraction, "threads": torch.get_num_threads(),
            "rows": rows}


def print_table(report: dict[str, Any]) -> None:
    print(f"Perplexity, {report['model']} on {report['corpus']}: the first "
          f"{report['cached_fraction']:.0%} of each window's KV from the radixkv pool vs the "
          f"model alone")
    print(f"{'kv dtype':>8} {'context':>7} {'windows':>7} {'cached':>6} {'scored':>7} "
          f"{'ppl ref':>9} {'ppl pool':>9} {'dPPL %':>10} {'max|dlogit|':>11} {'s':>6}")
    for r in report["rows"]:
        print(f"{r['kv_dtype']:>8} {r['context']:>7} {r['windows']:>7} {r['cached_tokens']:>6} "
              f"{r['scored_tokens']:>7} {r['ppl_reference']:>9.4f} {r['ppl_pool']:>9.4f} "
              f"{r['delta_ppl_pct']:>+10.2e} {r['max_abs_logit_diff']:>11.2e} "
              f"{r['seconds']:>6.0f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kv-dtypes", default="fp32",
                   help="comma-separated KV formats of the pool (fp32; more as they come)")
    p.add_argument("--contexts", default="512,2048,8192", help="window lengths in tokens")
    p.add_argument("--windows", type=int, default=None,
                   help="windows per context (default: as many as cover 8,192 tokens)")
    p.add_argument("--cached-fraction", type=float, default=0.5,
                   help="part of each window whose KV comes from the pool (0.5)")
    p.add_argument("--model", default="smollm2-135m", help="a registered model with a tokenizer")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = p.parse_args()
    from radixkv.errors import RadixKVError

    try:
        report = run(args)
    except RadixKVError as e:
        raise SystemExit(f"kv_accuracy: {e}") from None
    if not args.json:
        print_table(report)
    summary = {f"dppl_pct/max_dlogit@{r['kv_dtype']}/{r['context']}":
               f"{r['delta_ppl_pct']:+.1e}/{r['max_abs_logit_diff']:.1e}" for r in report["rows"]}
    emit("kv_accuracy", report if args.json else summary, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
