"""Write the synthetic chat workload as token JSONL.

    python bench/gen_workload.py --requests 2000 --seed 0 --out bench/out/synthetic.jsonl

Shared system prompts, multi-turn conversations whose later turns extend earlier ones, unique
user messages, Poisson arrivals (see radixkv.replay.workload.generate_synthetic).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit  # noqa: E402

from radixkv.replay.workload import generate_synthetic, write_token_jsonl  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench/out/synthetic.jsonl"))
    p.add_argument("--system-prompts", type=int, default=4)
    p.add_argument("--system-prompt-tokens", type=int, default=1200)
    p.add_argument("--user-tokens", type=int, default=250)
    p.add_argument("--answer-tokens", type=int, default=150)
    p.add_argument("--max-turns", type=int, default=5)
    p.add_argument("--active", type=int, default=32, help="conversations in flight")
    p.add_argument("--rate", type=float, default=10.0, help="requests per second")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    requests = generate_synthetic(
        args.requests,
        args.seed,
        num_system_prompts=args.system_prompts,
        system_prompt_tokens=args.system_prompt_tokens,
        user_tokens=args.user_tokens,
        answer_tokens=args.answer_tokens,
        max_turns=args.max_turns,
        num_active=args.active,
        requests_per_s=args.rate,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_token_jsonl(requests, args.out)
    tokens = sum(r.num_tokens for r in requests)
    emit(
        "gen_workload",
        {
            "out": str(args.out),
            "requests": len(requests),
            "prompt_tokens": tokens,
            "mean_prompt_tokens": tokens / max(1, len(requests)),
            "seconds": time.perf_counter() - t0,
        },
        args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
