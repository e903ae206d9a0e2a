"""`radixkv` command line: builds the parser from the command modules (radixkv/cli/commands/)
and dispatches to the one named. No command and no service logic here."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from radixkv.cli import commands
from radixkv.protocol.errors import RadixKVError


def build_parser() -> argparse.ArgumentParser:
    """The `radixkv` parser: one subcommand per module in `commands.COMMANDS`, in that order."""
    parser = argparse.ArgumentParser(
        prog="radixkv",
        description="radixkv: a prefix KV-cache service for LLM inference engines.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in commands.COMMANDS:
        importlib.import_module(f"{commands.__name__}.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `radixkv` on `argv` (default: sys.argv); the command's exit status, 2 on a
    radixkv error, 130 on Ctrl-C."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except RadixKVError as e:
        print(f"radixkv {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
