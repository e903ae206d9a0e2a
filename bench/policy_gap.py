"""How much of the LRU -> Belady gap each eviction policy closes, over the Mooncake traces.

    python bench/policy_gap.py [--json] [--plot bench/out/policy_gap.png]
    python bench/policy_gap.py --traces T1,T2 --capacities 1024,4096,16384 --limit 2000

Every trace x capacity cell replays the trace through a bare tree (radixkv.replay.simulate,
512-token blocks for Mooncake traces) with LRU, LFU, `adaptive`, and `adaptive` with retention
hints derived from the trace (radixkv.replay.hints: the last request of each chain is a session
end; that reads the trace's future, so it stands for **client-supplied knowledge**), beside
Belady's MIN over the same blocks (radixkv.replay.optimum). It prints the token hit rates and
`gap_closed` = (policy - LRU) / (Belady - LRU), then the averages over the cells, and draws
the hit rate over time (windows of requests) of every policy in every cell into one PNG.
`--json`: {"rows": [{trace, capacity_blocks, policy, token_hit_rate, gap_closed}], ...}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO  # noqa: E402

from radixkv.replay.client import block_keys  # noqa: E402
from radixkv.replay.hints import session_hints  # noqa: E402
from radixkv.replay.optimum import belady  # noqa: E402
from radixkv.replay.simulate import replay_tree  # noqa: E402
from radixkv.replay.workload import iter_trace  # noqa: E402

TRACES = REPO.parent / "shared" / "traces" / "mooncake"
DEFAULT_TRACES = f"{TRACES / 'conversation_trace.jsonl'},{TRACES / 'synthetic_trace.jsonl'}"
POLICIES = ("lru", "lfu", "adaptive", "adaptive+hints")


def trace_facts(path: str, block_size: int, limit: int | None) -> dict[str, Any]:
    """Per request: prompt tokens and full-block keys; the derived hints."""
    prompt, keys = [], []
    for r in iter_trace(path, limit):
        prompt.append(r.num_tokens)
        keys.append(block_keys(r.namespace, r.tokens, block_size).tolist())
    return {"prompt": np.asarray(prompt, dtype=np.int64), "keys": keys,
            "hints": session_hints(keys)}


def windows(hit: np.ndarray, prompt: np.ndarray, n: int) -> list[float]:
    """Token hit rate in `n` consecutive windows of requests."""
    return [float(h.sum() / max(1, p.sum()))
            for h, p in zip(np.array_split(hit, n), np.array_split(prompt, n), strict=True)]


def run_cell(path: str, facts: dict[str, Any], block_size: int, capacity: int,
             policies: list[str], limit: int | None, num_windows: int) -> list[dict[str, Any]]:
    prompt = facts["prompt"]
    total = int(prompt.sum())
    best = belady(facts["keys"], capacity)
    best_hits = np.asarray(best.per_request_hit_blocks, dtype=np.int64) * block_size
    rates: dict[str, tuple[float, np.ndarray, float]] = {}
    for name in policies:
        policy, hints = name.removesuffix("+hints"), name.endswith("+hints")
        t0 = time.perf_counter()
        r = replay_tree(iter_trace(path, limit), block_size, capacity, policy,
                        keep_per_request=True, hints=facts["hints"] if hints else None)
        hits = np.asarray(r.per_request_hit_tokens, dtype=np.int64)
        rates[name] = (r.token_hit_rate, hits, time.perf_counter() - t0)
    rates["belady"] = (float(best_hits.sum() / total), best_hits, 0.0)
    lru = rates["lru"][0] if "lru" in rates else None
    top = rates["belady"][0]
    rows = []
    for name, (rate, hits, seconds) in rates.items():
        gap = None if lru is None or top <= lru else (rate - lru) / (top - lru)
        rows.append({"trace": Path(path).name, "capacity_blocks": capacity, "policy": name,
                     "token_hit_rate": rate, "gap_closed": gap, "replay_s": seconds,
                     "over_time": windows(hits, prompt, num_windows)})
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Average gap closed per policy, and whether each policy is >= LRU in every cell."""
    out: dict[str, Any] = {}
    lru = {(r["trace"], r["capacity_blocks"]): r["token_hit_rate"]
           for r in rows if r["policy"] == "lru"}
    for name in dict.fromkeys(r["policy"] for r in rows):
        mine = [r for r in rows if r["policy"] == name]
        gaps = [r["gap_closed"] for r in mine if r["gap_closed"] is not None]
        out[name] = {
            "mean_gap_closed": sum(gaps) / len(gaps) if gaps else None,
            "min_gap_closed": min(gaps) if gaps else None,
            "cells_at_or_above_lru": sum(r["token_hit_rate"] >= lru[(r["trace"],
                                         r["capacity_blocks"])] for r in mine if lru),
            "cells": len(mine),
        }
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = list(dict.fromkeys((r["trace"], r["capacity_blocks"]) for r in rows))
    traces = list(dict.fromkeys(t for t, _ in cells))
    caps = list(dict.fromkeys(c for _, c in cells))
    fig, axes = plt.subplots(len(traces), len(caps), figsize=(5 * len(caps), 3.6 * len(traces)),
                             squeeze=False, sharex=True)
    for (trace, cap) in cells:
        ax = axes[traces.index(trace)][caps.index(cap)]
        for r in rows:
            if (r["trace"], r["capacity_blocks"]) == (trace, cap):
                x = np.linspace(0, 100, len(r["over_time"]))
                style = "--" if r["policy"] == "belady" else "-"
                ax.plot(x, np.asarray(r["over_time"]) * 100, style,
                        label=f"{r['policy']} ({r['token_hit_rate']:.1%})")
        ax.set_title(f"{trace}, {cap:,} blocks", fontsize=9)
        ax.set_xlabel("% of the trace's requests")
        ax.set_ylabel("token hit rate, %")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle("Token hit rate over time; adaptive+hints uses trace-derived session ends "
                 "(client-supplied knowledge)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", default=DEFAULT_TRACES, help="comma-separated trace files")
    p.add_argument("--capacities", default="1024,4096,16384", help="cache sizes in blocks")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="comma-separated: lru, lfu, adaptive, adaptive+hints (Belady always)")
    p.add_argument("--block-size", type=int, default=512, help="512: Mooncake's hash-id blocks")
    p.add_argument("--limit", type=int, default=None, help="only the first N requests")
    p.add_argument("--windows", type=int, default=40, help="windows in the over-time plot")
    p.add_argument("--plot", default=str(REPO / "bench" / "out" / "policy_gap.png"),
                   help="PNG path ('' for none)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    rows: list[dict[str, Any]] = []
    caps = [int(c) for c in args.capacities.split(",")]
    policies = args.policies.split(",")
    for path in args.traces.split(","):
        if not Path(path).is_file():
            print(f"policy_gap: trace not found: {path}", file=sys.stderr)
            return 2
        facts = trace_facts(path, args.block_size, args.limit)
        for cap in caps:
            rows += run_cell(path, facts, args.block_size, cap, policies, args.limit,
                             args.windows)
            if not args.json:
                for r in rows[-len(policies) - 1:]:
                    gap = "" if r["gap_closed"] is None else f"{r['gap_closed']:+.1%}"
                    print(f"{r['trace']:26s} {cap:>6,} {r['policy']:15s} "
                          f"{r['token_hit_rate']:7.2%}  gap closed {gap}", flush=True)
    summary = summarize(rows)
    if args.plot:
        plot(rows, Path(args.plot))
    if args.json:
        print(json.dumps({"bench": "policy_gap", "block_size": args.block_size,
                          "rows": [{k: r[k] for k in ("trace", "capacity_blocks", "policy",
                                                      "token_hit_rate", "gap_closed")}
                                   for r in rows],
                          "summary": summary, "plot": args.plot or None}, indent=2))
    else:
        for name, s in summary.items():
            mean = "-" if s["mean_gap_closed"] is None else f"{s['mean_gap_closed']:+.1%}"
            print(f"{name:15s} mean gap closed {mean}, >= LRU in "
                  f"{s['cells_at_or_above_lru']}/{s['cells']} cells")
        if args.plot:
            print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
