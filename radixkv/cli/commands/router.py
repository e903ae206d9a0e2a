"""`radixkv router`: serve a cache-aware router for a cluster (radixkv/cluster/router_server.py)
until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
from typing import Any

from radixkv.cli.flags import (
    add_etcd_flags,
    add_process_flags,
    etcd_security_from_args,
    start_logging,
)


def register(sub: Any) -> None:
    """Add `radixkv router`."""
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
    add_process_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Serve the router until stopped."""
    from radixkv.cluster.router_server import BANNER, RouterConfig, serve_router
    from radixkv.protocol.env import client_token
    from radixkv.rpc.auth import read_token
    from radixkv.rpc.process import exit_with_parent

    start_logging(args)
    if args.exit_with_parent:
        exit_with_parent()

    def ready(address: str) -> None:
        print(f"{BANNER} {address}: members from {args.etcd}", flush=True)

    config = RouterConfig(args.etcd, args.listen,
                          read_token(args.auth_token_file, client_token()),
                          args.tls_cert, args.tls_key, args.insecure,
                          etcd_security_from_args(args))
    return serve_router(config, ready)

