"""Perplexity with KV read from the radixkv pool vs the model alone (SmolLM2-135M, pydoc corpus).

    python bench/kv_accuracy.py [--kv-dtypes fp32,int8,int4-naive,int4] [--contexts 512,2048,8192]
                                [--json] [--plot dppl.png]

For each KV format (radixkv/engines/evaluate.py KV_FORMATS: fp32, int8, int4-naive, int4-group32,
int4-kchannel, int4-sinks, int4), starts `radixkv serve` (host pool, the model's layout stored in
that format) on a temporary socket; a spawned engine process writes the first half of every
window's KV into the pool and this process reads it back to score the second half. Each context
covers the corpus's first 8,192 tokens (16 windows of 512, 4 of 2,048, 1 of 8,192) unless
--windows says otherwise. One row per (format, context): ppl_reference (the model computing the
whole window), ppl_pool, delta_ppl_pct, max_abs_logit_diff, kl_mean, top1_agree, and per-layer
k_snr_db / v_snr_db. With fp32 KV the two agree to float rounding. Progress goes to stderr; each
format takes a few minutes on 2 cores (the model's own pass over each window is computed once
and shared by the formats).
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
            flags = [*loaded.serve_flags(directory), *evaluate.KV_FORMATS[kv_dtype],
                     "--block-size", str(args.block_size), "--num-blocks", str(num_blocks),
                     "--kv-sink-fraction", "0.5"]
            with radixkv_server(directory, *flags) as sock:
                for row in evaluate.run_accuracy(
                        sock, loaded, kv_dtype, contexts, args.windows, args.cached_fraction,
                        progress=lambda m: print(m, file=sys.stderr, flush=True)):
                    rows.append(row.to_dict())
                    print(f"{kv_dtype} context {row.context}: ppl {row.ppl_reference:.4f} -> "
                          f"{row.ppl_pool:.4f} ({row.delta_ppl_pct:+.2e} %), KL "
                          f"{row.kl_mean:.2e}, top-1 {row.top1_agree:.4f}",
                          file=sys.stderr, flush=True)
    return {"model": args.model, "corpus": "pydoc_data.topics", "block_size": args.block_size,
            "cached_fraction": args.cached_fraction, "threads": torch.get_num_threads(),
            "rows": rows}


def _mean_snr(values: list[float | None]) -> str:
    finite = [v for v in values if v is not None]
    return "exact" if not finite else f"{sum(finite) / len(finite):.1f}"


def print_table(report: dict[str, Any]) -> None:
    print(f"Perplexity, {report['model']} on {report['corpus']}: the first "
          f"{report['cached_fraction']:.0%} of each window's KV from the radixkv pool vs the "
          f"model alone")
    print(f"{'kv format':>13} {'context':>7} {'windows':>7} {'ppl ref':>9} {'ppl pool':>9} "
          f"{'dPPL %':>9} {'KL':>9} {'top-1':>7} {'K SNR dB':>8} {'V SNR dB':>8} {'s':>5}")
    for r in report["rows"]:
        print(f"{r['kv_dtype']:>13} {r['context']:>7} {r['windows']:>7} "
              f"{r['ppl_reference']:>9.4f} {r['ppl_pool']:>9.4f} {r['delta_ppl_pct']:>+9.3f} "
              f"{r['kl_mean']:>9.2e} {r['top1_agree']:>7.4f} {_mean_snr(r['k_snr_db']):>8} "
              f"{_mean_snr(r['v_snr_db']):>8} {r['seconds']:>5.0f}")


def plot(report: dict[str, Any], path: str) -> None:
    """dPPL % against context length, one line per KV format."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for fmt in dict.fromkeys(r["kv_dtype"] for r in report["rows"]):
        rows = sorted((r for r in report["rows"] if r["kv_dtype"] == fmt),
                      key=lambda r: r["context"])
        ax.plot([r["context"] for r in rows], [r["delta_ppl_pct"] for r in rows], marker="o",
                label=fmt)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens); the first half's KV read from the pool")
    ax.set_ylabel("perplexity change, %")
    ax.set_title(f"{report['model']}: KV format error against context length")
    ax.axhline(0, color="grey", lw=0.5)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", file=sys.stderr)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kv-dtypes", default="fp32",
                   help="comma-separated KV formats: fp32, int8, int4-naive, int4-group32, "
                        "int4-kchannel, int4-sinks, int4 (default fp32)")
    p.add_argument("--plot", metavar="PNG", help="write dPPL against context per format here")
    p.add_argument("--contexts", default="512,2048,8192", help="window lengths in tokens")
    p.add_argument("--windows", type=int, default=None,
                   help="windows per context (default: as many as cover 8,192 tokens)")
    p.add_argument("--cached-fraction", type=float, default=0.5,
                   help="part of each window whose KV comes from the pool (0.5)")
    p.add_argument("--model", default="smollm2-135m", help="a registered model with a tokenizer")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = p.parse_args()
    from radixkv.protocol.errors import RadixKVError

    try:
        report = run(args)
    except RadixKVError as e:
        raise SystemExit(f"kv_accuracy: {e}") from None
    if not args.json:
        print_table(report)
    if args.plot:
        plot(report, args.plot)
    summary = {f"dppl_pct/kl/top1@{r['kv_dtype']}/{r['context']}":
               f"{r['delta_ppl_pct']:+.2e}/{r['kl_mean']:.1e}/{r['top1_agree']:.4f}"
               for r in report["rows"]}
    emit("kv_accuracy", report if args.json else summary, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
