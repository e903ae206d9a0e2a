"""`radixkv gateway`: an OpenAI-compatible front end that routes each prompt to the engine whose
member holds its prefix (radixkv/gateway/http_app.py), until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
from typing import Any

from radixkv.cli.flags import (
    add_etcd_flags,
    add_process_flags,
    etcd_security_from_args,
    positive_float,
    start_logging,
)

DTYPES = ("bf16", "fp16", "fp32")


def register(sub: Any) -> None:
    """Add `radixkv gateway`."""
    p = sub.add_parser(
        "gateway", help="run an OpenAI-compatible, cache-aware gateway for engine servers",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and "
        "/metrics in front of N OpenAI-compatible engine servers (vLLM's `vllm serve` with "
        "the radixkv connector). Each prompt is tokenized as the engine will (--tokenizer, "
        "its chat template) and sent to the engine whose radixkv member holds the longest "
        "cached prefix, unless it is far busier (the cluster's index, from --cluster); an "
        "engine that fails is left out with backoff and the request goes to the next.")
    p.add_argument("--engine", action="append", default=[], metavar="URL=NODE_ID",
                   help="an engine server and the node id of its radixkv member (repeat; "
                   "a bare URL: an engine with no member). Without --engine, the engines are "
                   "those the members advertise (radixkv serve --engine-url)")
    p.add_argument("--cluster", metavar="etcd://HOST:PORT[/NAME]",
                   help="the members' cluster in etcd: where the cached prefixes are read "
                   "from (without it the gateway balances by load alone)")
    p.add_argument("--cluster-token-file", metavar="PATH",
                   help="the cluster token (the members' --auth-token-file; default "
                   "$RADIXKV_AUTH_TOKEN): sent to members, and only records signed with it "
                   "are followed")
    p.add_argument("--tokenizer", required=True, metavar="PATH|NAME",
                   help="the served model's tokenizer and chat template (its directory or hub "
                   "name, as given to `vllm serve`)")
    p.add_argument("--namespace", metavar="NS",
                   help="the engines' connector namespace (default: the connector's own for "
                   "a model served by that name: vllm:<--tokenizer>@main/<--dtype>)")
    p.add_argument("--dtype", choices=DTYPES, default="bf16",
                   help="the engines' KV dtype, for the default namespace (bf16)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (8000; 0: any)")
    p.add_argument("--auth-token-file", metavar="PATH",
                   help="require 'Authorization: Bearer TOKEN' (the file's first line) on every "
                   "path but /health")
    p.add_argument("--tls-cert", metavar="PEM", help="serve HTTPS with this certificate")
    p.add_argument("--tls-key", metavar="PEM", help="... and this private key")
    p.add_argument("--max-model-len", type=int, default=0, metavar="TOKENS",
                   help="refuse longer prompts here (default: as the engines' /v1/models say)")
    p.add_argument("--read-timeout", type=positive_float, default=600.0, metavar="SECONDS",
                   help="an engine silent this long mid-answer has failed (600)")
    add_etcd_flags(p)
    add_process_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Serve the gateway until stopped."""
    import asyncio

    from radixkv.cluster.router import Router
    from radixkv.gateway.engines import parse_engine
    from radixkv.gateway.http_app import BANNER, Gateway, GatewayConfig, serve
    from radixkv.gateway.prompts import Prompts
    from radixkv.integrations.vllm.scheduler import default_namespace
    from radixkv.protocol.env import client_token
    from radixkv.rpc.auth import read_token
    from radixkv.rpc.etcd import EtcdTarget
    from radixkv.rpc.process import exit_with_parent

    start_logging(args)
    if args.exit_with_parent:
        exit_with_parent()
    try:
        engines = [parse_engine(e) for e in args.engine]
    except ValueError as e:
        raise SystemExit(f"radixkv gateway: {e}") from None
    if not engines and not args.cluster:
        raise SystemExit("radixkv gateway: name the engines (--engine URL=NODE_ID) or the "
                         "cluster whose members advertise them (--cluster)")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("radixkv gateway: --tls-cert and --tls-key go together")
    config = GatewayConfig(
        engines, args.tokenizer,
        args.namespace or default_namespace(args.tokenizer, None, args.dtype),
        args.host, args.port, read_token(args.auth_token_file, None), args.tls_cert,
        args.tls_key, args.max_model_len, args.read_timeout)
    router = None
    if args.cluster:
        router = Router(EtcdTarget.parse(args.cluster),
                        read_token(args.cluster_token_file, client_token()),
                        etcd_security_from_args(args))
        router.start()
    try:
        gateway = Gateway(config, router, Prompts(args.tokenizer))
        asyncio.run(serve(gateway, lambda url: print(
            f"{BANNER} {url}: {len(engines) or 'advertised'} engines, namespace "
            f"{config.namespace}", flush=True)))
    finally:
        if router is not None:
            router.stop()
    return 0
