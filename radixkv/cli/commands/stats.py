"""`radixkv stats`: the cache summary of a running service (radixkv/cli/summary.py), once, or
reprinted every --watch SECONDS until Ctrl-C."""

from __future__ import annotations

import argparse
import json
import signal
import time
from typing import Any

from radixkv.cli.flags import connection_parent, service_target
from radixkv.cli.render import show
from radixkv.cli.summary import render_summary, summary
from radixkv.client import Client


def register(sub: Any) -> None:
    """Add `radixkv stats`."""
    p = sub.add_parser("stats", parents=[connection_parent(False)],
                       help="the cache summary, once or live")
    p.add_argument("--watch", type=float, default=0, metavar="SECONDS",
                   help="refresh every SECONDS until Ctrl-C")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the summary, or watch it."""
    with Client(service_target(args)) as kv:
        if args.watch:
            return watch(kv, args.watch, args.json)
        show(summary(kv), args.json, render_summary)
    return 0


def watch(kv: Client, seconds: float, as_json: bool) -> int:
    """Reprint the summary every `seconds` until Ctrl-C (rich Live on a terminal; plain
    reprints, or JSON lines, otherwise). Ctrl-C only sets a flag, read between calls: an
    interrupt raised inside a gRPC call could leave the channel unable to close."""
    from rich.console import Console
    from rich.live import Live

    console = Console()
    stopped: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda *_: stopped.append(1))

    def pause() -> bool:
        """Sleep `seconds` (in steps, so Ctrl-C is seen at once); False once it was pressed."""
        end = time.monotonic() + seconds
        while not stopped and time.monotonic() < end:
            time.sleep(min(0.05, max(0.0, end - time.monotonic())))
        return not stopped

    try:
        if as_json or not console.is_terminal:
            while not stopped:
                d = summary(kv)
                if as_json:
                    print(json.dumps(d), flush=True)
                else:
                    console.print(render_summary(d))
                pause()
            return 0
        with Live(render_summary(summary(kv)), console=console, auto_refresh=False) as live:
            while pause():
                live.update(render_summary(summary(kv)), refresh=True)
        return 0
    finally:
        signal.signal(signal.SIGINT, previous)

