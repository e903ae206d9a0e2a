"""`radixkv serve`: run the service (radixkv/server/app.py) from its pool, service, transport and
cluster flags, sized by --num-blocks or --memory, until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from kvpool.layout import parse_bytes
from radixkv.cli.flags import (
    add_disk_flags,
    add_etcd_flags,
    add_layout_flags,
    add_policy_flag,
    add_process_flags,
    add_sink_fraction_flag,
    disk_settings,
    etcd_security_from_args,
    layout_from_args,
    positive_float,
    positive_int,
    start_logging,
    window_fraction_from_args,
)
from radixkv.protocol.errors import RadixKVError


def register(sub: Any) -> None:
    """Add `radixkv serve`: pool, service and transport flags."""
    p = sub.add_parser("serve", help="run the service",
                       description="Run the radixkv service: one block pool (host shared memory "
                       "or CUDA), a radix tree per namespace, gRPC on a Unix socket. Stops on "
                       "SIGTERM/SIGINT, unlinking the socket and the shared memory.")
    add_layout_flags(p, default_preset="llama-3.2-1b")
    g = p.add_argument_group("pool")
    g.add_argument("--num-blocks", type=positive_int, default=None,
                   help="pool size in blocks (default 1024, or $RADIXKV_NUM_BLOCKS)")
    g.add_argument("--memory", help="pool size as memory, e.g. 8GiB (overrides --num-blocks)")
    g.add_argument("--backend", choices=["host", "cuda"], default=None,
                   help="host: POSIX shared memory (default); cuda: GPU memory via CuPy + IPC")
    g.add_argument("--device", type=int, default=None, help="CUDA device ordinal (cuda backend)")
    add_sink_fraction_flag(g, "with --kv-dtype and sink tokens: the share of blocks that can "
                           "start a sequence (sink blocks, a little larger; default 0.125)", "F")
    g.add_argument("--window-fraction", metavar="F",
                   help="sliding-window layouts only: the share of the pool's bytes that holds "
                        "window parts (the windowed layers' KV, kept only for the last window "
                        "of each cached sequence); the rest holds full parts (the full-attention "
                        "layers' KV of every cached block). Default: the window parts' share of "
                        "one cached 4,096-token conversation (gemma-3-like 0.56, gpt-oss-like "
                        "0.03); all-windowed layouts take 1. With --num-blocks (the full parts) "
                        "it sets the window parts' count; without it there are as many")
    g.add_argument("--num-window-blocks", type=positive_int, metavar="N",
                   help="sliding-window layouts with --num-blocks: exactly N window parts "
                        "(instead of --window-fraction)")
    add_disk_flags(p)
    g = p.add_argument_group("service")
    g.add_argument("--lease-ttl", type=positive_float, default=None,
                   help="seconds a lease lives without use before its pins are dropped "
                   "(default $RADIXKV_LEASE_TTL, else 30)")
    g.add_argument("--max-lease-ttl", type=positive_float, default=3600.0, metavar="SECONDS",
                   help="the longest lease TTL a client may ask for (3600)")
    g.add_argument("--max-leases", type=positive_int, default=65536, metavar="N",
                   help="live leases in all, whatever the clients (65536): bounds the "
                   "lease table that the sweeper and Stats walk")
    g.add_argument("--max-leases-per-client", type=positive_int, default=4096, metavar="N",
                   help="live leases one client may hold (4096); a client is its connection on "
                   "TCP, its client id on the Unix socket (which admits only this user)")
    g.add_argument("--max-namespaces", type=positive_int, default=1024, metavar="N",
                   help="namespaces that hold blocks or leases at once (1024)")
    g.add_argument("--max-namespaces-per-client", type=positive_int, default=None,
                   metavar="N", help="namespaces one client's live leases may span, so that "
                   "no client holds every namespace (default: a quarter of --max-namespaces)")
    add_policy_flag(g)
    g.add_argument("--max-tokens", type=positive_int, default=1 << 20,
                   help="longest token list accepted")
    g.add_argument("--vocab-size", type=positive_int, default=None,
                   help="reject token ids >= this (default: any uint32)")
    g.add_argument("--event-buffer", type=int, default=65536, metavar="N",
                   help="KV events kept for subscribers to resume from (65536); one that falls "
                   "further behind gets `lagged` and rebuilds from DumpTree")
    g.add_argument("--no-lookup-table", dest="lookup_table", action="store_false",
                   help="do not publish the lookup table (a shared-memory projection of the "
                   "cache that engines read prompts' cached prefixes from without a call: "
                   "docs/architecture.md); engines then ask with a Match")
    g = p.add_argument_group("transport")
    g.add_argument("--socket", default=None, metavar="PATH",
                   help="Unix socket path (default: $RADIXKV_SOCKET, $XDG_RUNTIME_DIR/radixkv.sock"
                   " or /tmp/radixkv-$UID/radixkv.sock); '' with --tcp for TCP only")
    g.add_argument("--tcp", default=None, metavar="HOST:PORT",
                   help="also listen on TCP (off by default; use 127.0.0.1 unless you mean it); "
                   "needs a token (--auth-token-file) or --insecure")
    g.add_argument("--insecure", action="store_true",
                   help="allow --tcp without a token (logged loudly): every local user, and "
                   "anyone who reaches the port, can then read and clear the cache")
    g.add_argument("--tls-cert", metavar="PEM", help="TLS certificate for the TCP port")
    g.add_argument("--tls-key", metavar="PEM", help="TLS private key for the TCP port")
    g.add_argument("--auth-token-file", metavar="PATH",
                   help="require 'authorization: Bearer TOKEN' on every radixkv call (token: "
                   "the file's first line; default $RADIXKV_AUTH_TOKEN; only the health Check "
                   "stays open)")
    g.add_argument("--workers", type=positive_int, default=2,
                   help="threads running calls (2: Python runs one at a time, more only "
                   "contend for the GIL)")
    g.add_argument("--cpus", metavar="LIST",
                   help="run the server on these CPUs only (e.g. 3, or 2,3): it is bound to "
                   "about one core by Python's GIL, and threads that hop between cores pay "
                   "for it in cache misses (one pinned core: +25-30%% requests/s with 8 "
                   "clients on 2 cores); default: wherever the OS puts it")
    g.add_argument("--stream-workers", type=positive_int, default=16,
                   help="concurrent server streams, e.g. `radixkv events` subscribers (16); "
                   "one more is refused (RESOURCE_EXHAUSTED), not queued")
    g.add_argument("--streams-per-peer", type=positive_int, default=None, metavar="N",
                   help="server streams one TCP peer may hold (default: half of "
                   "--stream-workers); Unix-socket clients share the total only")
    g.add_argument("--max-concurrent-rpcs", type=positive_int, default=256, metavar="N",
                   help="calls and streams running or queued at once; one more is refused "
                   "with RESOURCE_EXHAUSTED at once instead of waiting in a queue (256)")
    g.add_argument("--max-message-bytes", type=positive_int, default=64 << 20,
                   help="largest request accepted (64 MiB)")
    g.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on this port (127.0.0.1; 0 or absent: off)")
    _add_cluster_flags(p)
    add_process_flags(p)
    p.set_defaults(func=run)


def _add_cluster_flags(p: Any) -> None:
    g = p.add_argument_group("cluster (radixkv/rpc/membership.py)")
    g.add_argument("--cluster", metavar="etcd://HOST:PORT[/NAME]",
                   help="register this server as a member of the cluster NAME (default "
                   "'default') in etcd, for `radixkv router`; off by default")
    g.add_argument("--node-id", metavar="ID", help="this member's id in the cluster")
    g.add_argument("--advertise", metavar="ADDR",
                   help="the address members publish for engines and routers (default: the "
                   "first one this server listens on, e.g. unix:///path)")
    g.add_argument("--engine-url", metavar="URL", default="",
                   help="the OpenAI server of the engine that uses this member (e.g. "
                   "http://10.0.0.5:8000), advertised in etcd so that `radixkv gateway` "
                   "without --engine flags sends it the prompts this member holds")
    g.add_argument("--cluster-ttl", type=positive_int, default=5, metavar="SECONDS",
                   help="the registration's etcd lease: a crashed member drops out after this "
                   "(5); a clean stop leaves at once")
    add_etcd_flags(g)
    g = p.add_argument_group("KV events on vLLM's wire (radixkv/server/vllm_events.py)")
    g.add_argument("--kv-events-endpoint", metavar="ENDPOINT", default=None,
                   help="publish BlockStored / BlockRemoved / AllBlocksCleared as vLLM does: a "
                   "ZMQ PUB that binds for tcp://*:PORT, ipc:// and inproc://, and connects to "
                   "the rest (a subscriber that binds)")
    g.add_argument("--kv-events-replay-endpoint", metavar="ENDPOINT", default=None,
                   help="a ZMQ ROUTER (bound) that resends buffered batches from a sequence on")
    g.add_argument("--kv-events-topic", default="", metavar="TOPIC",
                   help="the topic frame of every message (default empty)")
    g.add_argument("--kv-events-encoding", choices=("map", "array"), default="map",
                   help="events as tagged maps (vLLM since mid-2026, the default) or "
                   "positional arrays (earlier vLLM and the consumers built on it)")
    g = p.add_argument_group("peer fetch between members (radixkv/cluster/peer_fetch.py)")
    g.add_argument("--peer-fetch", action="store_true",
                   help="with --cluster: before a Match, pull the blocks of the prompt that "
                   "another member holds beyond what this one has (over its address, with the "
                   "cluster token), so every member reuses every member's KV; host pools of "
                   "one block format (docs/cluster.md)")
    g.add_argument("--peer-fetch-min-blocks", type=positive_int, default=4, metavar="N",
                   help="fetch only when a peer holds at least N blocks more than here (4)")
    g.add_argument("--peer-fetch-timeout", type=positive_float, default=2.0, metavar="SECONDS",
                   help="the longest a Match waits for peers (2; also at most 0.8 of the "
                   "Match's own deadline); what arrived verified by then is used")


def run(args: argparse.Namespace) -> int:
    """Build the server config from the flags (and the environment) and serve."""

    from radixkv.rpc.auth import read_token
    from radixkv.rpc.process import exit_with_parent, pin_cpus
    from radixkv.server.app import serve
    from radixkv.server.config import ServerConfig

    start_logging(args)
    if args.cpus:  # before any thread starts: they inherit it
        try:
            pin_cpus(args.cpus)
        except RadixKVError as e:
            raise SystemExit(f"radixkv serve: {e}") from None
    from kvpool.sizing import fit_blocks, fit_window_blocks

    layout = layout_from_args(args)
    num_blocks, num_window_blocks = args.num_blocks, args.num_window_blocks
    window_fraction = window_fraction_from_args(layout, args.window_fraction)
    if num_window_blocks is not None and (not layout.is_windowed or args.memory
                                          or window_fraction is not None):
        raise SystemExit("--num-window-blocks needs a sliding-window layout and --num-blocks "
                         "(not --memory or --window-fraction)")
    if args.memory:
        if layout.blocks_in(parse_bytes(args.memory)) < 1:
            raise SystemExit(f"--memory {args.memory} holds no {layout.bytes_per_block}-byte block")
        if layout.is_windowed:  # full parts and window parts, split by the window fraction
            num_blocks, num_window_blocks = fit_window_blocks(
                layout, parse_bytes(args.memory), window_fraction)
            window_fraction = None
        else:
            num_blocks = fit_blocks(layout, parse_bytes(args.memory), args.kv_sink_fraction)
    config = ServerConfig.from_env(
        layout=layout, num_blocks=num_blocks, backend=args.backend, device=args.device,
        sink_fraction=args.kv_sink_fraction, num_window_blocks=num_window_blocks,
        window_fraction=window_fraction,
        socket=args.socket, tcp=args.tcp, max_message_bytes=args.max_message_bytes,
        workers=args.workers, stream_workers=args.stream_workers,
        max_concurrent_rpcs=args.max_concurrent_rpcs,
        streams_per_peer=args.streams_per_peer, insecure=args.insecure or None,
        metrics_port=args.metrics_port, tls_cert=args.tls_cert, tls_key=args.tls_key,
        auth_token=read_token(args.auth_token_file, None),  # None: from_env reads the env var
        cluster=args.cluster, node_id=args.node_id, advertise=args.advertise,
        cluster_ttl_s=args.cluster_ttl, engine_url=args.engine_url,
        etcd_security=etcd_security_from_args(args), lookup_table=args.lookup_table,
        **disk_settings(args))
    _check_cluster_flags(args)
    ttl = {} if args.lease_ttl is None else {"lease_ttl_s": args.lease_ttl}  # else the env's
    config = replace(config, service=replace(
        config.service, max_tokens=args.max_tokens, vocab_size=args.vocab_size,
        policy=args.policy, event_buffer=args.event_buffer,
        max_leases_per_client=args.max_leases_per_client, max_lease_ttl_s=args.max_lease_ttl,
        max_leases=args.max_leases, max_namespaces=args.max_namespaces,
        max_namespaces_per_client=args.max_namespaces_per_client,
        **ttl))
    if args.exit_with_parent:
        exit_with_parent()

    return serve(config, lambda server: _ready(server, config, args))


def _check_cluster_flags(args: argparse.Namespace) -> None:
    if args.cluster and not args.node_id:
        raise SystemExit("radixkv serve: --cluster needs --node-id")
    if args.peer_fetch and not args.cluster:
        raise SystemExit("radixkv serve: --peer-fetch needs --cluster (the peers are its members)")
    if args.engine_url and not args.cluster:
        raise SystemExit("radixkv serve: --engine-url needs --cluster (it is advertised there)")
    if args.engine_url and not args.engine_url.startswith(("http://", "https://")):
        raise SystemExit(f"radixkv serve: --engine-url {args.engine_url!r}: an http(s) URL")


def _attach_peer_fetch(server: Any, config: Any, args: argparse.Namespace) -> None:
    from radixkv.cluster.peer_fetch import PeerFetchConfig, PeerFetcher
    from radixkv.rpc.etcd import EtcdTarget

    settings = PeerFetchConfig(config.node_id, EtcdTarget.parse(config.cluster),
                               config.auth_token, config.etcd_security,
                               args.peer_fetch_min_blocks, args.peer_fetch_timeout)
    server.attach_peer_fetch(PeerFetcher(server.service, settings, server.servicer.peers))


def _ready(server: Any, config: Any, args: argparse.Namespace) -> None:
    """Once listening: peer fetch attached (--peer-fetch), then the banner tools wait for."""
    from kvpool.layout import format_bytes

    if args.peer_fetch:
        _attach_peer_fetch(server, config, args)
    if args.kv_events_endpoint:
        from radixkv.server.vllm_events import VllmEventPublisher, VllmEventsConfig

        server.attach_kv_events(VllmEventPublisher(
            server.service.events,
            VllmEventsConfig(args.kv_events_endpoint, args.kv_events_replay_endpoint,
                             args.kv_events_topic, args.kv_events_encoding),
            "GPU" if config.backend == "cuda" else "CPU", disk=bool(config.disk_dir)))

    pool = config.layout
    where = ", ".join(server.addresses)
    if not pool.is_windowed:
        print(f"radixkv serving on {where}: {config.backend} pool, {config.num_blocks} "
              f"blocks x {format_bytes(pool.bytes_per_block)} ({pool.block_size} tokens "
              f"each), epoch {server.pool.epoch}", flush=True)
        return
    blocks = server.pool
    full = blocks.num_full_blocks * pool.full_bytes_per_block
    window = blocks.num_window_blocks * pool.window_bytes_per_block
    print(f"radixkv serving on {where}: {config.backend} pool, {blocks.num_full_blocks} "
          f"full parts x {format_bytes(pool.full_bytes_per_block)} + "
          f"{blocks.num_window_blocks} window parts x "
          f"{format_bytes(pool.window_bytes_per_block)} ({pool.block_size} tokens each), "
          f"epoch {blocks.epoch}", flush=True)
    print(f"sliding window {pool.sliding_window} on {len(pool.window_layers)} of "
          f"{pool.num_layers} layers ({pool.window_pattern}): full parts "
          f"{format_bytes(full)} for the full-attention layers, window parts "
          f"{format_bytes(window)} for the windowed ones ({window / (full + window):.1%} "
          "of the pool)", flush=True)
