"""Two commits' headline figures, interleaved round by round in one run: the regression bench.

    python bench/compare.py BASE [HEAD]                    # HEAD defaults to HEAD
    python bench/compare.py 50ddf17 --benches tree,ttft --rounds 5 --json
    python bench/compare.py HEAD~3 HEAD --smoke            # tiny sizes: checks the harness

Checks BASE and HEAD out into two temporary git worktrees and runs each headline bench on both,
alternating which goes first from round to round (base, head; head, base; ...) so that a
shared machine's drift hits both alike. Every run is a subprocess of this interpreter with the
worktree first on PYTHONPATH (one venv: the code differs, not the packages). Per figure it
prints the median of each side, the median of the per-round ratios HEAD/BASE with their range
(the spread), and flags a figure that is worse than --threshold in its own direction (a higher
latency, a lower rate). A bench that fails or is missing on one side is reported, not fatal.
The worktrees are removed at the end, on an error and on SIGTERM.

| bench   | what runs                                             | figures                      |
| ------- | ----------------------------------------------------- | ---------------------------- |
| tree    | bench/tree_replay.py: synthetic chats, 8,192 blocks    | requests/s, match/insert p50 |
| rpc     | bench/rpc_latency.py on the Unix socket               | 2-trip cycle req/s, Match p50 |
| copy    | bench/pool_copy.py, plain fp16 and int8 blocks         | gather/scatter GB/s (>= 64K) |
| ttft    | bench/ttft.py, the bench model, 50 and 90 % shared    | TTFT ratio to no cache       |
| replay  | radixkv replay: one node of 8,192 blocks, 2 clients    | token hit rate               |
| cluster | radixkv replay: 4 members x 2,048 blocks, cache-aware | token hit rate               |

Before the timed rounds, each side runs every bench once at smoke size, untimed (kernel builds,
model conversion, cold caches). The replays read the Mooncake conversation trace from
../shared/traces (its first 4,000 requests) and fall back to the synthetic workload without it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO.parent / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"

Figures = Callable[[dict[str, Any]], dict[str, float]]


@dataclass(frozen=True)
class Bench:
    name: str
    argv: tuple[str, ...]  # after the interpreter; run in the worktree
    smoke: tuple[str, ...]  # the same at tiny sizes
    figures: Figures  # the bench's JSON -> {figure: value}
    lower_is_better: frozenset[str] = frozenset()


def _copy_figures(report: dict[str, Any]) -> dict[str, float]:
    """Geometric mean over the block sizes of >= 64 KiB, per format and direction."""
    logs: dict[str, list[float]] = {}
    for row in report["rows"]:
        if row["block_bytes"] >= 64 << 10:
            for op in ("gather", "scatter"):
                logs.setdefault(f"{row['kv_dtype']}_{op}_gbs", []).append(
                    math.log(max(row[f"{op}_gbs"], 1e-9)))
    return {name: math.exp(statistics.fmean(v)) for name, v in logs.items()}


def benches(trace: str) -> list[Bench]:
    replay = ("-m", "radixkv", "replay", "--json")
    if trace == "synthetic":
        data: tuple[str, ...] = ("--trace", "synthetic", "--block-size", "16")
        smoke_data: tuple[str, ...] = ("--trace", "synthetic", "--requests", "200",
                                       "--block-size", "16")
    else:
        data = ("--trace", trace, "--block-size", "512", "--limit", "4000")
        smoke_data = ("--trace", trace, "--block-size", "512", "--limit", "200")
    hit_rate: Figures = lambda r: {"token_hit_rate": r["token_hit_rate"]}  # noqa: E731
    return [
        Bench("tree",
              ("bench/tree_replay.py", "--trace", "synthetic", "--requests", "2000",
               "--block-size", "16", "--capacity-blocks", "8192", "--policy", "lru",
               "--no-memory", "--json"),
              ("bench/tree_replay.py", "--trace", "synthetic", "--requests", "300",
               "--warmup", "20", "--block-size", "16", "--capacity-blocks", "1024",
               "--policy", "lru", "--no-memory", "--json"),
              lambda r: {"requests_per_s": r["requests_per_s"],
                         "match_p50_us": r["match_us"]["p50"],
                         "insert_p50_us": r["insert_us"]["p50"]},
              frozenset({"match_p50_us", "insert_p50_us"})),
        Bench("rpc",
              ("bench/rpc_latency.py", "--transports", "unix", "--rounds", "2", "--seconds",
               "0.5", "--replicas", "1", "--json"),
              ("bench/rpc_latency.py", "--transports", "unix", "--rounds", "1", "--seconds",
               "0.2", "--replicas", "1", "--clients", "2", "--json"),
              lambda r: {"cycle_two_1_requests_per_s":
                         r["unix"]["cycle_two_1"]["requests_per_s"],
                         "cycle_two_n_requests_per_s":
                         r["unix"]["cycle_two_n"]["requests_per_s"],
                         "match_p50_us": r["unix"]["match_1"]["p50_us"]},
              frozenset({"match_p50_us"})),
        Bench("copy",
              ("bench/pool_copy.py", "--blocks", "256", "--repeat", "5", "--kv-dtypes", "int8",
               "--json"),
              ("bench/pool_copy.py", "--blocks", "4", "--repeat", "1", "--kv-dtypes", "int8",
               "--json"),
              _copy_figures),
        Bench("ttft",
              ("bench/ttft.py", "--shares", "50,90", "--repeat", "5", "--json"),
              ("bench/ttft.py", "--model", "test", "--prompt-tokens", "128", "--shares", "50",
               "--repeat", "1", "--json"),
              lambda r: {f"ratio_{row['shared_pct']}": row["ratio"] for row in r["rows"]},
              frozenset({"ratio_50", "ratio_90"})),
        Bench("replay", (*replay, *data, "--capacity-blocks", "8192", "--clients", "2"),
              (*replay, *smoke_data, "--capacity-blocks", "256", "--clients", "1"),
              hit_rate),
        Bench("cluster", (*replay, *data, "--nodes", "4", "--capacity-blocks", "2048",
                          "--routing", "cache-aware"),
              (*replay, *smoke_data, "--nodes", "2", "--capacity-blocks", "128",
               "--routing", "cache-aware"),
              hit_rate),
    ]


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def run_bench(tree: Path, argv: tuple[str, ...], timeout: float) -> dict[str, Any]:
    """One run of a bench in `tree`: its JSON report; RuntimeError with the output's tail."""
    if argv[0].startswith("bench/") and not (tree / argv[0]).exists():
        raise RuntimeError(f"{argv[0]} does not exist at this commit")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = subprocess.run([sys.executable, *argv], cwd=tree, env=env, capture_output=True,
                         text=True, timeout=timeout)
    if out.returncode:
        tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"exit {out.returncode}: " + " | ".join(tail))
    report: dict[str, Any] = json.loads(out.stdout[out.stdout.index("{"):])
    return report


def compare(args: argparse.Namespace, trees: dict[str, Path]) -> dict[str, Any]:
    chosen = [b for b in benches(args.trace) if b.name in args.benches]
    values: dict[tuple[str, str], dict[str, list[float]]] = {}
    ratios: dict[tuple[str, str], list[float]] = {}
    failures: list[dict[str, str]] = []
    if not args.smoke and not args.no_warmup:
        for bench in chosen:
            for side in ("base", "head"):
                with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired, ValueError):
                    run_bench(trees[side], bench.smoke, args.timeout)
                print(f"warm-up {bench.name} {side}", file=sys.stderr, flush=True)
    for round_index in range(args.rounds):
        sides = ("base", "head") if round_index % 2 == 0 else ("head", "base")
        for bench in chosen:
            got: dict[str, dict[str, float]] = {}
            for side in sides:
                t0 = time.perf_counter()
                try:
                    got[side] = bench.figures(run_bench(
                        trees[side], bench.smoke if args.smoke else bench.argv, args.timeout))
                except (RuntimeError, subprocess.TimeoutExpired, ValueError, KeyError) as e:
                    failures.append({"round": str(round_index + 1), "bench": bench.name,
                                     "side": side, "error": str(e)[-500:]})
                print(f"round {round_index + 1}/{args.rounds} {bench.name} {side}: "
                      f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
            for side, figures in got.items():
                for name, value in figures.items():
                    values.setdefault((bench.name, name), {}).setdefault(side, []).append(value)
            if len(got) == 2:
                for name, value in got["head"].items():
                    base = got["base"].get(name)
                    if base:
                        ratios.setdefault((bench.name, name), []).append(value / base)
    rows = []
    lower = {(b.name, f) for b in chosen for f in b.lower_is_better}
    for key, per_side in values.items():
        r = ratios.get(key, [])
        ratio = statistics.median(r) if r else None
        lower_better = key in lower
        worse = ratio is not None and (ratio > 1 + args.threshold if lower_better
                                       else ratio < 1 - args.threshold)
        rows.append({
            "bench": key[0], "figure": key[1], "better": "lower" if lower_better else "higher",
            "base": statistics.median(per_side["base"]) if "base" in per_side else None,
            "head": statistics.median(per_side["head"]) if "head" in per_side else None,
            "ratio": ratio, "ratio_min": min(r) if r else None,
            "ratio_max": max(r) if r else None, "rounds": len(r), "worse": worse})
    return {"bench": "compare", "base": args.base, "head": args.head,
            "base_commit": args.base_commit, "head_commit": args.head_commit,
            "rounds": args.rounds, "threshold": args.threshold, "smoke": args.smoke,
            "trace": args.trace, "figures": rows, "failures": failures,
            "worse": [f"{r['bench']}.{r['figure']}" for r in rows if r["worse"]]}


def print_table(report: dict[str, Any]) -> None:
    print(f"HEAD {report['head']} ({report['head_commit'][:9]}) / BASE {report['base']} "
          f"({report['base_commit'][:9]}), {report['rounds']} interleaved rounds")
    print(f"{'figure':<36}{'base':>12}{'head':>12}{'head/base':>11}  spread")
    for r in report["figures"]:
        def num(x: float | None) -> str:
            return "-" if x is None else f"{x:.4g}"
        spread = (f"{r['ratio_min']:.3f}-{r['ratio_max']:.3f}" if r["ratio"] is not None
                  else "-")
        flag = f"  WORSE ({r['better']} is better)" if r["worse"] else ""
        print(f"{r['bench'] + '.' + r['figure']:<36}{num(r['base']):>12}{num(r['head']):>12}"
              f"{num(r['ratio']):>11}  {spread}{flag}")
    for f in report["failures"]:
        print(f"failed: round {f['round']} {f['bench']} on {f['side']}: {f['error']}")


def main() -> None:
    names = [b.name for b in benches("synthetic")]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("base", help="the commit to compare against (any git revision)")
    p.add_argument("head", nargs="?", default="HEAD", help="the commit measured (HEAD)")
    p.add_argument("--benches", default=",".join(names),
                   help=f"comma-separated, of {','.join(names)} (all)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (3)")
    p.add_argument("--threshold", type=float, default=0.05,
                   help="flag a figure worse than this fraction (0.05)")
    p.add_argument("--trace", default=str(TRACE) if TRACE.exists() else "synthetic",
                   help="the replays' trace (the Mooncake conversation trace if present)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks the harness")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up runs")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per bench run")
    p.add_argument("--fail-on-worse", action="store_true", help="exit 1 if a figure is flagged")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = p.parse_args()
    args.benches = [b.strip() for b in args.benches.split(",") if b.strip()]
    if unknown := set(args.benches) - set(names):
        p.error(f"unknown bench {', '.join(sorted(unknown))}; choose from {', '.join(names)}")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    try:
        args.base_commit = git("rev-parse", "--verify", f"{args.base}^{{commit}}")
        args.head_commit = git("rev-parse", "--verify", f"{args.head}^{{commit}}")
    except subprocess.CalledProcessError as e:
        p.error(f"not a commit here: {e.stderr.strip()}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: remove the worktrees
    with tempfile.TemporaryDirectory(prefix="rkv-compare-") as tmp:
        trees = {side: Path(tmp) / side for side in ("base", "head")}
        try:
            for side, commit in (("base", args.base_commit), ("head", args.head_commit)):
                git("worktree", "add", "--detach", str(trees[side]), commit)
            report = compare(args, trees)
        finally:
            for tree in trees.values():
                if tree.exists():
                    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                                    str(tree)], capture_output=True)
            git("worktree", "prune")
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    sys.exit(1 if args.fail_on_worse and report["worse"] else 0)


if __name__ == "__main__":
    main()
