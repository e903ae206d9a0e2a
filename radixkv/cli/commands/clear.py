"""`radixkv clear`: drop one namespace's cache in a running service (the Clear RPC; emits
AllBlocksCleared, refused while a lease holds blocks in it)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from radixkv.cli.flags import connection_parent


def register(sub: Any) -> None:
    """Add `radixkv clear`."""
    conn = [connection_parent(False)]
    p = sub.add_parser("clear", parents=conn, help="drop one namespace's cache",
                       description="Free every cached block of a namespace and forget it "
                       "(emits AllBlocksCleared). Refused while a lease holds blocks in it.")
    p.add_argument("namespace")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Clear the namespace and say how many blocks it freed."""
    from radixkv.client import Client

    with Client(args.target or args.socket) as kv:
        freed = kv.clear(args.namespace)
    if args.json:
        print(json.dumps({"namespace": args.namespace, "num_freed": freed}))
    else:
        print(f"cleared {args.namespace!r}: {freed} blocks freed")
    return 0
