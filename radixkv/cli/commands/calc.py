"""`radixkv calc`: the KV-cache memory calculator (kvpool/calc.py) for one model's layout: per
token, block, context and N requests, what a memory budget holds, at the model's dtype and at
int8 / int4."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvpool.layout import parse_bytes
from radixkv.cli.flags import add_layout_flags, layout_from_args


def register(sub: Any) -> None:
    """Add `radixkv calc`."""
    p = sub.add_parser("calc", help="KV-cache memory calculator",
                       description="Bytes per token and block, per context, per N requests, "
                       "and how many tokens fit in a memory budget, at the model's dtype and "
                       "at int8 / int4 (scale overhead included). For a sliding-window model "
                       "(a windowed preset, a config with sliding_window, or --sliding-window), "
                       "also the bytes per token of its full and windowed layers and what one "
                       "--context-token conversation costs when windowed layers keep only their "
                       "window, against every layer kept in full.")
    add_layout_flags(p, default_preset="llama-3-8b")
    p.add_argument("--context", type=int, default=4096, help="tokens in one context (4096)")
    p.add_argument("--requests", type=int, default=100, help="concurrent requests (100)")
    p.add_argument("--memory", help="a memory budget, e.g. 80GiB, to count the tokens that fit")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the report, as a table or JSON."""
    from kvpool.calc import calculate, render

    report = calculate(layout_from_args(args), args.context, args.requests,
                       parse_bytes(args.memory) if args.memory else None)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        from rich.console import Console

        Console().print(render(report))
    return 0
