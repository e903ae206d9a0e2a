"""`radixkv route`: one Route query to a router (a probe, for debugging): the members ranked by
cost, each with the prefix it holds cached."""

from __future__ import annotations

import argparse
import json
from typing import Any

from radixkv.protocol.errors import InvalidArgument


def register(sub: Any) -> None:
    """Add `radixkv route`."""
    p = sub.add_parser("route", help="ask a router where one prompt should go",
                       description="One Route query (a probe: not counted as load): the "
                       "members ranked by cost, each with the prefix it holds cached.")
    p.add_argument("--router", required=True, metavar="PATH|TARGET")
    p.add_argument("namespace")
    p.add_argument("tokens", nargs="*", type=int, help="token ids (or --tokens-file)")
    p.add_argument("--tokens-file", help="a file of whitespace-separated token ids")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Ask the router once and print its ranking."""
    from radixkv.cluster.routed import RouterClient

    tokens = list(args.tokens)
    if args.tokens_file:
        with open(args.tokens_file) as f:
            tokens += [int(t) for t in f.read().split()]
    if not tokens:
        raise InvalidArgument("give token ids, or --tokens-file")
    with RouterClient(args.router) as rc:
        answer = rc.route(args.namespace, tokens, probe=True)
    rows = [{"node_id": m.node_id, "address": m.address, "epoch": m.epoch,
             "cached_tokens": m.cached_tokens, "cost": m.cost, "load": m.load}
            for m in answer.members]
    if args.json:
        print(json.dumps({"namespace": args.namespace, "num_tokens": len(tokens),
                          "block_size": answer.block_size,
                          "namespace_known": answer.namespace_known, "members": rows}))
        return 0
    known = "" if answer.namespace_known else " (no member holds this namespace)"
    print(f"{args.namespace}: {len(tokens)} tokens, block size {answer.block_size}{known}")
    for i, r in enumerate(rows, 1):
        print(f"  {i}. {r['node_id']:<12} cached {r['cached_tokens']:>7} tokens  cost "
              f"{r['cost']:>9.0f}  load {r['load']:>4.0f}  {r['address']}")
    return 0

