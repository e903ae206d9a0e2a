"""The cluster commands: `radixkv router` (serve one), `radixkv route` (one query, for
debugging) and `radixkv inspect --router` (members, health, epochs, index size, hit rates)."""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

from radixkv.cli.flags import add_etcd_flags, etcd_security_from_args
from radixkv.errors import InvalidArgument


def add_router(sub: Any) -> None:
    p = sub.add_parser("router", help="run a cache-aware router for a cluster",
                       description="Watch a cluster's members in etcd, follow each member's KV "
                       "events into one prefix index, and answer Route(namespace, tokens): the "
                       "members ranked by uncached prefill tokens + load (radixkv/cluster/"
                       "router.py). Advisory: engines then talk to the member directly.")
    p.add_argument("--etcd", required=True, metavar="etcd://HOST:PORT[/NAME]",
                   help="etcd and the cluster name the members registered under")
    p.add_argument("--listen", required=True, metavar="PATH|HOST:PORT",
                   help="a Unix socket path (or unix:///path), or HOST:PORT (use 127.0.0.1; "
                   "needs a token or --insecure)")
    p.add_argument("--auth-token-file", metavar="PATH",
                   help="the cluster token (the members' --auth-token-file; default "
                   "$RADIXKV_AUTH_TOKEN): required from callers, sent to members, and only "
                   "member records signed with it are followed")
    p.add_argument("--tls-cert", metavar="PEM", help="TLS certificate for a TCP --listen")
    p.add_argument("--tls-key", metavar="PEM", help="TLS private key for a TCP --listen")
    p.add_argument("--insecure", action="store_true",
                   help="allow a TCP --listen without a token (logged loudly)")
    add_etcd_flags(p)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--exit-with-parent", action="store_true",
                   help="stop when the process that started this one exits (Linux)")
    p.set_defaults(func=cmd_router)


def cmd_router(args: argparse.Namespace) -> int:
    from radixkv.cluster.router_server import BANNER, RouterConfig, serve_router
    from radixkv.env import client_token
    from radixkv.server.app import exit_with_parent
    from radixkv.server.auth import read_token

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.exit_with_parent:
        exit_with_parent()

    def ready(address: str) -> None:
        print(f"{BANNER} {address}: members from {args.etcd}", flush=True)

    config = RouterConfig(args.etcd, args.listen,
                          read_token(args.auth_token_file, client_token()),
                          args.tls_cert, args.tls_key, args.insecure,
                          etcd_security_from_args(args))
    return serve_router(config, ready)


def add_route(sub: Any) -> None:
    p = sub.add_parser("route", help="ask a router where one prompt should go",
                       description="One Route query (a probe: not counted as load): the "
                       "members ranked by cost, each with the prefix it holds cached.")
    p.add_argument("--router", required=True, metavar="PATH|TARGET")
    p.add_argument("namespace")
    p.add_argument("tokens", nargs="*", type=int, help="token ids (or --tokens-file)")
    p.add_argument("--tokens-file", help="a file of whitespace-separated token ids")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_route)


def cmd_route(args: argparse.Namespace) -> int:
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


def inspect_router(target: str, as_json: bool) -> int:
    from radixkv.cluster.routed import RouterClient

    with RouterClient(target) as rc:
        d = rc.members()
    if as_json:
        print(json.dumps(d, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"router {target}: {len(d['members'])} members in etcd {d['etcd']} "
                  f"{d['prefix']}, {d['routes']} routes, up {d['uptime_s']:.0f}s",
                  box=None, header_style="bold")
    for col in ("member", "state", "epoch", "address", "indexed blocks", "namespaces",
                "events", "resyncs", "routed", "leases", "hit rate"):
        table.add_column(col, justify="left" if col in ("member", "state", "epoch", "address")
                         else "right")
    for m in d["members"]:
        rate = f"{m['hit_tokens'] / m['query_tokens']:.1%}" if m["query_tokens"] else "-"
        state = m["state"] if not m["error"] else f"{m['state']} ({m['error'][:60]})"
        table.add_row(m["node_id"], state, m["epoch"][:12], m["address"],
                      f"{m['indexed_blocks']:,}", str(m["namespaces"]),
                      f"{m['events_applied']:,}", str(m["resyncs"]), f"{m['routed']:,}",
                      str(m["live_leases"]), rate)
    Console().print(table)
    return 0
