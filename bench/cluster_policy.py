"""The default eviction policy against LRU, on one node and on a cluster's members, in one run.

    python bench/cluster_policy.py [--trace T] [--limit 4000] [--json]

Runs `radixkv replay` (real services, bytes verified) four times on the same trace: one node of
--capacity-blocks x --nodes blocks (2 clients) and a cluster of --nodes members of
--capacity-blocks each behind the cache-aware router, each with the default policy and with
`lru`. Reports the token hit rates, the cluster over the one node per policy, and the default
over LRU per shape. A member sees the share of the traffic the router sends it (whole
conversations, by cached prefix), which is where a policy tuned on one node's traffic can lose.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, emit  # noqa: E402

from radixkv.index.policies import DEFAULT_POLICY  # noqa: E402

TRACE = REPO.parent / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"


def replay(args: argparse.Namespace, policy: str, cluster: bool) -> dict[str, Any]:
    shape = (["--nodes", str(args.nodes), "--capacity-blocks", str(args.capacity_blocks),
              "--routing", "cache-aware"] if cluster else
             ["--capacity-blocks", str(args.capacity_blocks * args.nodes), "--clients", "2"])
    data = (["--trace", args.trace, "--block-size", "512", "--limit", str(args.limit)]
            if args.trace != "synthetic" else
            ["--trace", "synthetic", "--requests", str(args.limit), "--block-size", "16"])
    cmd = [sys.executable, "-m", "radixkv", "replay", *data, *shape, "--policy", policy,
           "--json"]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd[1:])} exited {out.returncode}: {out.stderr[-1500:]}")
    report: dict[str, Any] = json.loads(out.stdout)
    print(f"{'cluster' if cluster else 'one node'} {policy}: {report['token_hit_rate']:.4f} "
          f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=str(TRACE) if TRACE.exists() else "synthetic",
                   help="a Mooncake trace (512-token blocks), or 'synthetic'")
    p.add_argument("--limit", type=int, default=4000, help="requests replayed (4000)")
    p.add_argument("--nodes", type=int, default=4, help="cluster members (4)")
    p.add_argument("--capacity-blocks", type=int, default=2048, help="blocks per member (2048)")
    p.add_argument("--policy", default=DEFAULT_POLICY, help=f"against lru ({DEFAULT_POLICY})")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per replay")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rows = []
    for cluster in (True, False):
        for policy in (args.policy, "lru"):
            r = replay(args, policy, cluster)
            rows.append({"shape": "cluster" if cluster else "one node", "policy": policy,
                         "nodes": args.nodes if cluster else 1,
                         "capacity_blocks": args.capacity_blocks * (1 if cluster else args.nodes),
                         "token_hit_rate": r["token_hit_rate"],
                         "verified_blocks": r["verified_blocks"], "mismatches": r["mismatches"]})
    rate = {(row["shape"], row["policy"]): row["token_hit_rate"] for row in rows}
    emit("cluster_policy", {
        "trace": Path(args.trace).name, "limit": args.limit, "rows": rows,
        "cluster_over_one_node": {pol: rate[("cluster", pol)] / rate[("one node", pol)]
                                  for pol in (args.policy, "lru")},
        "default_over_lru": {shape: rate[(shape, args.policy)] / rate[(shape, "lru")]
                             for shape in ("cluster", "one node")},
    }, args.json)


if __name__ == "__main__":
    main()
