"""`radixkv` command line: parses flags and calls into the package. No service logic here."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from radixkv.errors import RadixKVError
from radixkv.layout import PRESETS, KVLayout, parse_bytes


def add_layout_flags(p: argparse.ArgumentParser, default_preset: str | None) -> None:
    g = p.add_argument_group("KV layout (one model)")
    g.add_argument("--preset", default=default_preset, choices=sorted(PRESETS),
                   help=f"built-in model geometry (default: {default_preset})")
    g.add_argument("--model-config", metavar="PATH",
                   help="a Hugging Face config.json (or its folder) instead of --preset")
    g.add_argument("--dtype", choices=["fp32", "fp16", "bf16", "fp8", "int8", "int4"],
                   help="KV element type (default: the model's, usually bf16)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per block (default: 16)")


def layout_from_args(args: argparse.Namespace) -> KVLayout:
    if args.model_config:
        return KVLayout.from_hf_config(args.model_config, args.dtype, args.block_size)
    if not args.preset:
        raise SystemExit("give --preset NAME or --model-config PATH")
    return KVLayout.from_preset(args.preset, args.dtype, args.block_size)


def cmd_calc(args: argparse.Namespace) -> int:
    from radixkv.calc import calculate, render

    report = calculate(layout_from_args(args), args.context, args.requests,
                       parse_bytes(args.memory) if args.memory else None)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        from rich.console import Console

        Console().print(render(report))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radixkv",
        description="radixkv: a prefix KV-cache service for LLM inference engines.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("calc", help="KV-cache memory calculator",
                       description="Bytes per token and block, per context, per N requests, "
                       "and how many tokens fit in a memory budget, at the model's dtype and "
                       "at int8 / int4 (scale overhead included).")
    add_layout_flags(p, default_preset="llama-3-8b")
    p.add_argument("--context", type=int, default=4096, help="tokens in one context (4096)")
    p.add_argument("--requests", type=int, default=100, help="concurrent requests (100)")
    p.add_argument("--memory", help="a memory budget, e.g. 80GiB, to count the tokens that fit")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_calc)

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except RadixKVError as e:
        print(f"radixkv {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
