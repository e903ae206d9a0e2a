"""Peer fetch at cluster scale: a trace replayed over N members, routed round-robin and
cache-aware, each with and without `--peer-fetch`, against one node of all the capacity.

    .venv/bin/python bench/peer_replay.py --json      # the Mooncake conversation trace
    .venv/bin/python bench/peer_replay.py --limit 300 --json     # a smoke run

Each row is one `radixkv replay --nodes N --capacity-blocks C --clients K --routing R
[--peer-fetch] --json` (the first also with --reference: one node of N x C blocks, the figure to
reach); every hit's bytes verified. Figures: token hit rate, its ratio to the reference,
mismatches, the blocks and bytes fetched and the fetch p50.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from _common import emit, log

TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "mooncake" / \
    "conversation_trace.jsonl"
RUNS = (("round-robin", False), ("round-robin", True), ("cache-aware", False),
        ("cache-aware", True))


def replay(args: argparse.Namespace, routing: str, peer: bool, reference: bool) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "radixkv", "replay", "--trace", args.trace, "--nodes",
           str(args.nodes), "--capacity-blocks", str(args.capacity_blocks), "--clients",
           str(args.clients), "--routing", routing, "--json",
           *(["--peer-fetch"] if peer else []), *(["--reference"] if reference else []),
           *(["--limit", str(args.limit)] if args.limit else [])]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return dict(json.loads(out.stdout))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=str(TRACE), help="a Mooncake JSONL trace (the "
                   "conversation trace)")
    p.add_argument("--nodes", type=int, default=4, help="members (4)")
    p.add_argument("--capacity-blocks", type=int, default=2048, help="blocks per member (2048)")
    p.add_argument("--clients", type=int, default=2, help="client processes (2)")
    p.add_argument("--limit", type=int, default=0, help="replay only the first N requests")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if not Path(args.trace).is_file():
        raise SystemExit(f"trace not found: {args.trace}")
    rows, reference = [], None
    for routing, peer in RUNS:
        d = replay(args, routing, peer, reference is None)
        reference = reference if reference is not None else d["reference_token_hit_rate"]
        row = {"routing": routing, "peer_fetch": peer, "token_hit_rate": d["token_hit_rate"],
               "mismatches": d["mismatches"], "verified_blocks": d["verified_blocks"],
               "peer_fetched_blocks": d.get("peer_fetched_blocks") or 0,
               "peer_fetch_bytes": d.get("peer_fetch_bytes") or 0,
               "peer_fetch_p50_ms": d.get("peer_fetch_p50_ms"), "wall_s": d["wall_s"],
               "num_requests": d["num_requests"]}
        row["vs_reference"] = row["token_hit_rate"] / reference if reference else None
        log(f"peer replay: {routing}{' + peer fetch' if peer else ''}: hit rate "
            f"{row['token_hit_rate']:.4f} ({row['vs_reference']:.3f}x one node), "
            f"{row['peer_fetched_blocks']} blocks fetched, {row['mismatches']} mismatches")
        rows.append(row)
    by = {(r["routing"], r["peer_fetch"]): r for r in rows}
    out = {"trace": Path(args.trace).name, "nodes": args.nodes,
           "capacity_blocks": args.capacity_blocks, "clients": args.clients,
           "reference_token_hit_rate": reference, "rows": rows,
           "round_robin_peer_vs_reference": by[("round-robin", True)]["vs_reference"],
           "cache_aware_peer_vs_without": by[("cache-aware", True)]["token_hit_rate"]
           / by[("cache-aware", False)]["token_hit_rate"]}
    emit("peer_replay", out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
