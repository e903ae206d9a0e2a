"""What caching only the window buys a sliding-window model: the conversation trace replayed at
one memory budget, windowed-aware against treating every layer as full.

    python bench/swa_capacity.py [--json] [--memory 80GiB] [--layouts gpt-oss-like,...]
    python bench/swa_capacity.py --limit 2000 --trace path/to/trace.jsonl

For each layout (a preset with a sliding window), two `radixkv replay` runs on the same trace
and the same bytes of KV memory, each with its own service and every hit verified:
- *windowed-aware*: the pool holds full parts (the full-attention layers' KV of every cached
  block) and window parts (the windowed layers' KV, kept only for the last window_blocks blocks
  of each resume point); memory split by --window-fraction (default: the window parts' share
  of one conversation of the trace's mean prompt length);
- *all-full*: every layer's KV of every cached block, as a cache unaware of the window would.
Each run ends by counting the conversations (chains of prompts, each extending the previous:
radixkv.replay.hints) whose last prompt is still cached whole. Rows: `layout`,
`conversations_ratio` (held windowed-aware / all-full), `hit_rate_windowed`,
`hit_rate_all_full`, `mismatches` (both runs), the pool counts, and the static cost of one
mean conversation both ways (`radixkv calc`'s arithmetic).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, summary_line  # noqa: E402

from kvpool.layout import KVLayout, parse_bytes  # noqa: E402
from kvpool.sizing import default_window_fraction, fit_blocks, fit_window_blocks  # noqa: E402
from radixkv.replay.cluster import ReplayWindow  # noqa: E402
from radixkv.replay.runner import MOONCAKE_BLOCK_SIZE, run_replay  # noqa: E402
from radixkv.replay.workload import iter_trace  # noqa: E402

TRACE = REPO.parent / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"
LAYOUTS = "gpt-oss-like,gemma-3-like,mistral-7b-v0.1"


def row(name: str, trace: str, memory: int, limit: int | None, clients: int,
        policy: str, fraction: float | None, mean_tokens: int) -> dict[str, Any]:
    layout = KVLayout.from_preset(name, None, MOONCAKE_BLOCK_SIZE)
    f = default_window_fraction(layout, mean_tokens) if fraction is None else fraction
    full, windows = fit_window_blocks(layout, memory, f)
    all_full = fit_blocks(layout.with_window(None), memory, 0.0)
    common = dict(block_size=MOONCAKE_BLOCK_SIZE, clients=clients, policy=policy, limit=limit,
                  conversations=True, trace_name=trace)
    t0 = time.perf_counter()
    aware = run_replay(trace, capacity_blocks=full, **common,  # type: ignore[arg-type]
                       window=ReplayWindow(layout.sliding_window or 0, windows,
                                           all_windowed=not layout.full_layers))
    base = run_replay(trace, capacity_blocks=all_full, **common)  # type: ignore[arg-type]
    return {
        "layout": name, "sliding_window": layout.sliding_window,
        "window_pattern": layout.window_pattern, "window_blocks": layout.window_blocks,
        "memory_bytes": memory, "window_fraction": round(f, 4),
        "full_parts": full, "window_parts": windows, "all_full_blocks": all_full,
        "conversations": aware.conversations,
        "conversations_windowed": aware.conversations_held,
        "conversations_all_full": base.conversations_held,
        "conversations_ratio": round(aware.conversations_held
                                     / max(1, base.conversations_held), 3),
        "hit_rate_windowed": round(aware.token_hit_rate, 5),
        "hit_rate_all_full": round(base.token_hit_rate, 5),
        "mismatches": aware.mismatches + base.mismatches,
        "verified_blocks": aware.verified_blocks + base.verified_blocks,
        "integrity": f"{aware.integrity}/{base.integrity}",
        "mean_prompt_tokens": mean_tokens,
        "conversation_bytes_windowed": layout.conversation_bytes(mean_tokens),
        "conversation_bytes_all_full": layout.conversation_bytes(mean_tokens, windowed=False),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=str(TRACE), help="a Mooncake JSONL trace "
                   "(default: the conversation trace)")
    p.add_argument("--memory", default="80GiB", help="KV memory of both caches (80GiB)")
    p.add_argument("--layouts", default=LAYOUTS, help=f"presets with a window ({LAYOUTS})")
    p.add_argument("--window-fraction", type=float, default=None,
                   help="share of the memory for window parts (default: per layout, the "
                   "window parts' share of one conversation of the trace's mean prompt)")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--clients", type=int, default=1, help="replay client processes (1)")
    p.add_argument("--policy", default="lru", help="eviction policy of both services (lru)")
    p.add_argument("--json", action="store_true", help="print {rows: [...]} as JSON")
    args = p.parse_args()
    if not Path(args.trace).is_file():
        p.error(f"trace not found: {args.trace}")
    lengths = [r.num_tokens for r in iter_trace(args.trace, args.limit)]
    mean_tokens = int(statistics.mean(lengths))
    rows = []
    for name in args.layouts.split(","):
        rows.append(row(name, args.trace, parse_bytes(args.memory), args.limit, args.clients,
                        args.policy, args.window_fraction, mean_tokens))
        print(f"{name}: done in {rows[-1]['seconds']} s", file=sys.stderr)
    out = {"trace": args.trace, "memory": args.memory, "policy": args.policy,
           "requests": len(lengths), "rows": rows}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        keys = ("window_fraction", "full_parts", "window_parts", "all_full_blocks",
                "conversations_windowed", "conversations_all_full", "conversations_ratio",
                "hit_rate_windowed", "hit_rate_all_full", "mismatches")
        for r in rows:
            print(summary_line(r["layout"], {k: r[k] for k in keys}))
    return 1 if any(r["mismatches"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
