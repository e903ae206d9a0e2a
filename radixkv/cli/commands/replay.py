"""`radixkv replay`: a trace against a real service, verified, beside the optimum. Its flags,
what a --memory budget holds, and the run (radixkv.replay.runner) from parsed flags."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from radixkv.cli.flags import QUANTIZED_KV_DTYPES, add_policy_flag, add_sink_fraction_flag
from radixkv.protocol.errors import InvalidArgument
from radixkv.replay.cluster import ReplayWindow, StartedCluster
from radixkv.replay.plots import write_plots
from radixkv.replay.report import render_report
from radixkv.replay.routing import POLICIES as ROUTING_POLICIES
from radixkv.replay.runner import DEFAULT_PREFILL_TOKENS_PER_S, MOONCAKE_BLOCK_SIZE, run_replay
from radixkv.replay.workload import Request, generate_synthetic


def register(sub: Any) -> None:
    """Add `radixkv replay` and its flags."""
    p = sub.add_parser("replay", help="replay a request trace against the service",
                       description="Replay a trace (Mooncake, token JSONL or synthetic) against a "
                       "running service from several client processes, verify every hit's bytes, "
                       "and report hit rate, latency and prefill saved beside the offline optimum "
                       "(Belady) and the infinite-capacity ceiling.")
    p.add_argument("--trace", default="synthetic",
                   help="a Mooncake or token JSONL file, or 'synthetic' (default)")
    p.add_argument("--requests", type=int, default=2000, help="synthetic requests (2000)")
    p.add_argument("--seed", type=int, default=0, help="synthetic workload seed (0)")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--block-size", type=int, default=None,
                   help=f"tokens per block (default {MOONCAKE_BLOCK_SIZE} for Mooncake traces, "
                   "whose hash ids are 512-token blocks; 16 otherwise)")
    p.add_argument("--capacity-blocks", type=int, default=16384,
                   help="cache capacity in blocks: the started service's --num-blocks (16384)")
    p.add_argument("--memory", metavar="BYTES",
                   help="instead of --capacity-blocks: the blocks of --preset's layout stored as "
                   "--kv-dtype that fit in this much memory, e.g. 40GiB (sink region included)")
    p.add_argument("--preset", default="llama-3-8b",
                   help="the model layout --memory is counted in (default llama-3-8b)")
    p.add_argument("--kv-dtype", default="bf16", choices=("bf16", *QUANTIZED_KV_DTYPES),
                   help="the KV format --memory is counted in (default bf16)")
    p.add_argument("--window-fraction", type=float, default=None, metavar="F",
                   help="a sliding-window --preset (gpt-oss-like, gemma-3-like, "
                   "mistral-7b-v0.1): the share of --memory for window parts (default: their "
                   "share of one 4,096-token conversation); the replayed service then keeps "
                   "window parts only for the last window of each resume point")
    p.add_argument("--all-full", action="store_true",
                   help="count --memory as if every layer of the preset were full attention "
                   "(the window-unaware baseline)")
    p.add_argument("--conversations", action="store_true",
                   help="at the end, count the conversations (chains of prompts, each "
                   "extending the last) whose last prompt is still cached whole")
    add_sink_fraction_flag(p, "int8/int4: the share of sink blocks (a sequence's first block), "
                           "as `radixkv serve` (0.125)")
    add_policy_flag(p, " of the started service")
    p.add_argument("--hints", action="store_true",
                   help="send retention hints derived from the trace: the last request of each "
                   "chain is a session end (client-supplied knowledge: it reads the future)")
    p.add_argument("--clients", type=int, default=4, help="client processes (4)")
    p.add_argument("--target", default=None, metavar="SOCKET|TARGET",
                   help="replay against this running service instead of starting one (its "
                   "block size and capacity are used)")
    p.add_argument("--speed", type=float, default=0.0,
                   help="follow the trace timestamps divided by this (2: twice as fast); "
                   "0 (default): as fast as possible")
    p.add_argument("--round-trips", type=int, choices=(2, 4), default=2,
                   help="per request: 2 (Match also allocates, Insert also releases; default) "
                   "or 4 (Match, Allocate, Insert, Release)")
    _add_cluster_flags(p)
    g = p.add_argument_group("disk tier (docs/disk-tier.md)")
    g.add_argument("--disk-capacity-blocks", type=int, default=0, metavar="N",
                   help="give the started service a disk tier of N blocks below its "
                   "--capacity-blocks pool (0, default: none)")
    g.add_argument("--disk-dir", metavar="DIR",
                   help="the disk tier's directory (default: a temporary one)")
    g.add_argument("--disk-read-gbps", type=float, default=2.0, metavar="GB/S",
                   help="the disk read bandwidth the disk hits are priced at, with --preset's "
                   "KV bytes per token in --kv-dtype (default 2.0, an assumed local NVMe; "
                   "give yours, e.g. bench/disk_tier.py's fs_read_GBps)")
    p.add_argument("--no-verify", action="store_true",
                   help="do not write and check block bytes (on by default)")
    p.add_argument("--prefill-tokens-per-s", type=float, default=DEFAULT_PREFILL_TOKENS_PER_S,
                   help="prefill rate to turn saved tokens into TTFT (default 10,000: an "
                   "assumed 70B-class rate, see radixkv/replay/runner.py; give your engine's)")
    p.add_argument("--windows", type=int, default=40, help="hit-rate-over-time windows (40)")
    p.add_argument("--plots", metavar="DIR", help="write PNG plots here")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


@dataclass(frozen=True, slots=True)
class MemoryCapacity:
    """What a `radixkv serve --memory` pool of one layout holds."""

    blocks: int  # the replayed service's capacity: blocks, or a windowed pool's full parts
    sink_fraction: float
    window_blocks: int = 0  # a sliding-window pool's window parts
    note: str = ""  # for the report: how a windowed pool's memory splits
    window: ReplayWindow | None = None  # the replayed service's window (windowed presets)


def _add_cluster_flags(p: Any) -> None:
    g = p.add_argument_group("cluster (radixkv/replay/routing.py)")
    g.add_argument("--nodes", type=int, default=0, metavar="N",
                   help="start etcd, N members of --capacity-blocks each and a router, and "
                   "replay over them (0, default: one service)")
    g.add_argument("--router", default=None, metavar="ADDR",
                   help="replay over a running cluster through this router instead")
    g.add_argument("--routing", default="cache-aware",
                   choices=ROUTING_POLICIES,
                   help="how each request's member is chosen (cache-aware: the router's Route)")
    g.add_argument("--kill-member-after", type=int, default=None, metavar="REQUESTS",
                   help="SIGKILL one member (with --nodes) once this many requests are done")
    g.add_argument("--reference", action="store_true",
                   help="also replay on one node of N x --capacity-blocks (with --nodes) and "
                   "report the cluster's hit rate against it")
    g.add_argument("--peer-fetch", action="store_true",
                   help="the members pull a prompt's prefix from the member that holds it "
                   "(serve --peer-fetch, with --nodes); the report adds peer_fetched_blocks, "
                   "peer_fetch_bytes, peer_fetch_p50_ms")


def memory_capacity(preset: str, kv_dtype: str, block_size: int, memory: str,
                    sink_fraction: float, window_fraction: float | None = None,
                    all_full: bool = False) -> MemoryCapacity:
    """The blocks of `preset`'s layout stored as `kv_dtype` in `memory` bytes: what a
    `radixkv serve --memory` pool of that format holds. A sliding-window preset's pool holds
    full parts and window parts (kvpool.sizing.fit_window_blocks, `window_fraction` or the
    default; quantized without sink tokens, as such a pool must be): the replay gets the full
    parts as its blocks beside the window parts (`window`). `all_full`: count the preset as if
    every layer were full attention (the baseline a window-unaware cache is)."""
    from kvpool.layout import KVLayout, parse_bytes
    from kvpool.sizing import default_window_fraction, fit_blocks, fit_window_blocks

    layout = KVLayout.from_preset(preset, None, block_size)
    if all_full:
        layout = layout.with_window(None)
    if kv_dtype != layout.dtype:
        layout = layout.with_dtype(kv_dtype, 0 if layout.is_windowed else None)
    if layout.is_windowed:
        f = default_window_fraction(layout) if window_fraction is None else window_fraction
        full, windows = fit_window_blocks(layout, parse_bytes(memory), f)
        note = (f"--memory {memory} of {preset} ({kv_dtype}, sliding window "
                f"{layout.sliding_window} on {len(layout.window_layers)} of "
                f"{layout.num_layers} layers) holds {full:,} full parts and {windows:,} window "
                f"parts (window fraction {f:.3f})")
        window = ReplayWindow(layout.sliding_window or 0, windows,
                              all_windowed=not layout.full_layers)
        return MemoryCapacity(full, 0.0, windows, note, window)
    blocks = fit_blocks(layout, parse_bytes(memory), sink_fraction)
    if blocks < 1:
        raise InvalidArgument(f"--memory {memory} holds no {kv_dtype} block of {preset}")
    return MemoryCapacity(blocks, sink_fraction if layout.sink_tokens else 0.0)


def _is_mooncake(path: str) -> bool:
    with open(path) as f:
        for line in f:
            if line.strip():
                return "hash_ids" in json.loads(line)
    return False


def disk_tier(args: argparse.Namespace) -> tuple[str, int] | None:
    """The replayed service's disk tier (directory, blocks) from the flags, or None."""
    if args.disk_capacity_blocks < 0:
        raise InvalidArgument("--disk-capacity-blocks must be >= 0")
    if not args.disk_capacity_blocks:
        if args.disk_dir:
            raise InvalidArgument("--disk-dir needs --disk-capacity-blocks")
        return None
    if args.target or args.router or args.nodes:
        raise InvalidArgument("--disk-capacity-blocks gives the service the replay starts a "
                              "disk tier (not --target, --router or --nodes)")
    return (args.disk_dir or "", args.disk_capacity_blocks)


def started_cluster(args: argparse.Namespace) -> StartedCluster | None:
    """The cluster the replay starts (--nodes and what goes with it), or None."""
    if args.peer_fetch and not args.nodes:
        raise InvalidArgument("--peer-fetch starts members that fetch from each other: with "
                              "--nodes")
    if args.kill_member_after is not None and not args.nodes:
        raise InvalidArgument("nodes must be >= 0; kill_member_after needs a cluster started "
                              "here (nodes > 0)")
    if not args.nodes:
        return None
    return StartedCluster(args.nodes, args.kill_member_after, args.reference, args.peer_fetch)


def run(args: argparse.Namespace) -> int:
    """Run `radixkv replay` from parsed flags; 1 if a hit's bytes came back wrong."""
    if args.trace == "synthetic":
        n = args.requests if args.limit is None else min(args.requests, args.limit)
        requests: list[Request] | str = generate_synthetic(n, args.seed)
        block_size = args.block_size or 16
    else:
        if not Path(args.trace).is_file():
            raise InvalidArgument(f"trace file not found: {args.trace}")
        requests = args.trace
        block_size = args.block_size or (MOONCAKE_BLOCK_SIZE if _is_mooncake(args.trace) else 16)
    target = args.target
    if target is not None and target.startswith("/"):
        target = f"unix://{target}"
    capacity, sink_fraction, note = args.capacity_blocks, 0.0, ""
    window: ReplayWindow | None = None
    if args.memory:
        counted = memory_capacity(args.preset, args.kv_dtype, block_size, args.memory,
                                  args.kv_sink_fraction, args.window_fraction, args.all_full)
        capacity, sink_fraction, note = counted.blocks, counted.sink_fraction, counted.note
        window = counted.window
    elif args.window_fraction is not None or args.all_full:
        raise InvalidArgument("--window-fraction and --all-full size a --memory budget")
    report = run_replay(
        requests, target=target, block_size=block_size, capacity_blocks=capacity,
        sink_fraction=sink_fraction,
        clients=args.clients, policy=args.policy, limit=args.limit, speed=args.speed,
        verify=not args.no_verify, round_trips=args.round_trips,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        num_windows=args.windows, progress=True,
        trace_name=args.trace, router=args.router, routing=args.routing,
        started=started_cluster(args), hints=args.hints,
        window=window, conversations=args.conversations,
        disk=disk_tier(args))
    if note:
        report = replace(report, notes=(*report.notes, note))
    if report.disk is not None:
        from kvpool.layout import KVLayout

        layout = KVLayout.from_preset(args.preset, None, block_size)
        if args.kv_dtype != layout.dtype:
            layout = layout.with_dtype(args.kv_dtype, 0)
        report = replace(report, disk=replace(
            report.disk, read_bytes_per_token=layout.bytes_per_block // block_size,
            read_GBps=args.disk_read_gbps))
    paths = write_plots(report, args.plots) if args.plots else []
    if args.json:
        out = report.to_dict()
        out["plots"] = [str(p) for p in paths]
        print(json.dumps(out, indent=2))
    else:
        from rich.console import Console

        console = Console()
        console.print(render_report(report))
        for path in paths:
            console.print(f"plot: {path}")
    return 1 if report.mismatches else 0
