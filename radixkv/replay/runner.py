"""`radixkv replay`: a request trace against a real running service, from several client
processes, as engines would drive it; every hit verified; the offline optimum beside it.

    main process                                  client processes (spawn) x N
    trace -> feeder thread ---- job queue ---->   Match -> Allocate the rest -> write the new
      (block keys)              (trace order)     blocks' bytes -> Insert -> Release
    progress bar, Stats polls <- result queue --  per-request hits, latencies, mismatches
    then: Belady and the ceiling over the same keys (radixkv.replay.optimum) -> ReplayReport

Clients (radixkv.replay.client) take requests in trace order from one queue, so the order
holds as far as concurrency allows. Each full block's key is a 64-bit chained hash of
namespace + token prefix; the writer puts it in the block's first 8 bytes through the pool
mapping, and every hit reads its blocks back and checks them (verification, on by default:
mismatches must be 0). The report is built by radixkv.replay.report.

With one client the service sees exactly radixkv.replay.simulate.replay_tree's per-request sequence
(one namespace, same block size, capacity and policy), so the hit tokens are equal, request by
request: Match pins the prefix (the tree's match + lock); Allocate evicts exactly what the
free list lacks; when even eviction cannot make room (a prompt longer than the capacity), it
fails with OutOfBlocks, and the client asks Stats for free + evictable blocks and allocates
that many instead, as replay_tree takes only what it can have; Insert commits matched + new
blocks; Release unpins. (A request that adds no block skips Insert; that changes no eviction
order.) With N > 1 clients requests overlap: a prefix inserted by one client may not yet be
visible to another, and pins of concurrent requests change what can be evicted, so the hit
rate differs slightly from replay_tree's; equality is asserted for 1 client only.

The service is started for the run (`python -m radixkv serve` on a temporary socket, one
KV layer / head / dim in fp16 so a block is 4 x block_size bytes) unless `target` names a
running one; then the block size and capacity are the server's, and namespaces get a per-run
prefix so earlier contents neither hit nor fail verification.

Over a cluster (`nodes` > 0 starts etcd, members and a router; `router` names a running one),
each client sends each request to the member radixkv.replay.routing picks; the Stats figures
are summed over the members (radixkv.replay.cluster), the optimum and the ceiling are those of
one node of the members' capacity summed, and the report adds the spread and Route's time.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import multiprocessing as mp
import queue
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from radixkv.errors import InvalidArgument, RadixKVError
from radixkv.index.policies import DEFAULT_POLICY
from radixkv.index.policies import POLICIES as EVICTION_POLICIES
from radixkv.replay.client import ClientArgs, block_keys, client_main
from radixkv.replay.cluster import (
    ClusterRun,
    ClusterStats,
    ReplayWindow,
    service_flags,
    start_cluster,
)
from radixkv.replay.hints import trace_hints
from radixkv.replay.report import (
    Cluster,
    Latency,
    ReplayReport,
    RunConfig,
    TraceLog,
    build_report,
    render_report,
    write_plots,
)
from radixkv.replay.workload import Request, generate_synthetic, iter_trace
from radixkv.server.launch import server_process

__all__ = ["ReplayReport", "block_keys", "render_report", "run_replay", "start_service"]

# Assumption, not a measurement: prefill costs ~2 x parameters FLOP per token, 1.4e11 for a 70B
# dense model. One H100 (989 TFLOPS dense bf16) peaks near 7,000 tokens/s at 100% utilization;
# 10,000 tokens/s is such a model on two H100s in bf16 (or one in fp8) at ~70% utilization.
# Pass your engine's measured prefill rate.
DEFAULT_PREFILL_TOKENS_PER_S = 10_000.0
MOONCAKE_BLOCK_SIZE = 512


@contextlib.contextmanager
def start_service(
    block_size: int, capacity_blocks: int, policy: str = DEFAULT_POLICY,
    sink_fraction: float = 0.0, window: ReplayWindow | None = None,
) -> Iterator[str]:
    """Run `radixkv serve` with a tiny layout on a temporary socket; yield the socket path.
    `sink_fraction` > 0 gives the pool a sink region of that share, as a quantized pool with
    sink tokens has (the tiny layout then stores int8). SIGTERM at exit."""
    with tempfile.TemporaryDirectory(prefix="rkv-replay-") as directory:
        flags = service_flags(directory, block_size, capacity_blocks, policy, sink_fraction,
                              window)
        with server_process(*flags) as server:
            yield server.socket


# ---- the run -------------------------------------------------------------------------------


def _feed(requests: Iterable[Request], block_size: int, prefix: str, jobs: Any, clients: int,
          trace: TraceLog, stop: threading.Event, hints: list[str | None] | None) -> None:
    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                jobs.put(item, timeout=0.2)
                return True
            except queue.Full:
                pass
        return False

    try:
        first_ts: float | None = None
        for index, req in enumerate(requests):
            namespace = prefix + req.namespace
            keys = block_keys(namespace, req.tokens, block_size)
            ts = req.timestamp_ms
            if ts is not None and first_ts is None:
                first_ts = ts
            due = None if ts is None or first_ts is None else ts - first_ts
            trace.prompt_tokens.append(req.num_tokens)
            trace.timestamps_ms.append(due)
            trace.keys.append(keys.tolist())
            hint = hints[index] if hints is not None else None
            if not put((index, namespace, req.tokens, due, keys.tobytes(), hint)):
                return
    except BaseException as e:  # a bad trace line: stop the clients, report it
        trace.error = e
    for _ in range(clients):
        put(None)


def _count_requests(source: Iterable[Request] | str | Path, limit: int | None) -> int | None:
    if isinstance(source, list | tuple):
        n = len(source)
    elif isinstance(source, str | Path):
        with open(source, "rb") as f:
            n = sum(1 for line in f if line.strip())
    else:
        return limit
    return n if limit is None else min(n, limit)


@dataclass(frozen=True, slots=True)
class ReplayOptions:
    """How a replay runs: `run_replay`'s arguments once checked."""

    name: str  # the trace's name in the report
    clients: int
    policy: str
    speed: float  # 0: as fast as possible; else trace time divided by this
    verify: bool
    prefill_tokens_per_s: float
    num_windows: int  # hit-rate-over-time windows in the report
    progress: bool
    total: int | None  # requests expected (None: unknown), for the progress bar
    round_trips: int = 2  # per request: 2 (Match allocates, Insert releases) or 4
    routing: str = "cache-aware"  # over a cluster: radixkv.replay.routing
    kill_member_after: int | None = None  # SIGKILL one member after this many requests
    hints: bool = False  # send retention hints derived from the trace (radixkv.replay.hints)
    conversations: bool = False  # count the conversations held at the end


def run_replay(
    requests: Iterable[Request] | str | Path,
    *,
    target: str | None = None,
    block_size: int = 16,
    capacity_blocks: int = 16384,
    clients: int = 4,
    policy: str = DEFAULT_POLICY,
    limit: int | None = None,
    speed: float = 0.0,
    verify: bool = True,
    round_trips: int = 2,
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S,
    num_windows: int = 40,
    progress: bool = False,
    trace_name: str = "",
    sink_fraction: float = 0.0,
    nodes: int = 0,
    router: str | None = None,
    routing: str = "cache-aware",
    kill_member_after: int | None = None,
    reference: bool = False,
    hints: bool = False,
    window: ReplayWindow | None = None,
    conversations: bool = False,
) -> ReplayReport:
    """Replay `requests` (Requests, or a Mooncake / token JSONL path, streamed) against the
    service at `target`, or against one started for the run with `block_size`,
    `capacity_blocks` and `policy`; see the module docstring. `speed` > 0 follows the trace
    timestamps divided by it; 0 sends as fast as the clients go.

    A cluster: `nodes` > 0 starts etcd, that many members of `capacity_blocks` each and a
    router (`router`: use a running cluster's router instead); each request goes to the member
    `routing` picks (radixkv.replay.routing). `kill_member_after`: SIGKILL member n0 (of a
    cluster started here) once that many requests are done. `reference`: also replay the trace
    on one node of nodes x capacity_blocks, the figure the cluster should approach. `hints`:
    send each request's retention hint derived from the trace's future (client-supplied
    knowledge; one extra pass over the trace first). `window`: the started service caches a
    sliding-window model (capacity_blocks full parts beside window.window_parts window parts;
    two round trips only). `conversations`: at the end, count the conversations whose last
    prompt is still cached whole (ReplayReport.conversations_held; one more pass over the
    trace)."""
    if clients < 1:
        raise InvalidArgument(f"clients must be >= 1, got {clients}")
    if round_trips not in (2, 4):
        raise InvalidArgument(f"round_trips must be 2 or 4, got {round_trips}")
    if window is not None and (round_trips != 2 or nodes or router or target):
        raise InvalidArgument("a sliding-window replay runs on a service it starts, with two "
                              "round trips")
    if speed < 0 or prefill_tokens_per_s <= 0:
        raise InvalidArgument("speed must be >= 0 and prefill_tokens_per_s > 0")
    from radixkv.replay.routing import POLICIES

    if routing not in POLICIES:
        raise InvalidArgument(f"routing {routing!r}: one of {', '.join(POLICIES)}")
    if sum(x is not None and x != 0 for x in (target, router, nodes)) > 1:
        raise InvalidArgument("give one of a target service, a router, or a number of nodes")
    if nodes < 0 or (kill_member_after is not None and not nodes):
        raise InvalidArgument("nodes must be >= 0; kill_member_after needs a cluster started "
                              "here (nodes > 0)")
    opts = ReplayOptions(
        trace_name or (str(requests) if isinstance(requests, str | Path) else "requests"),
        clients, policy, speed, verify, prefill_tokens_per_s, num_windows, progress,
        _count_requests(requests, limit), round_trips, routing, kill_member_after, hints,
        conversations)

    if not isinstance(requests, str | Path):  # a path is streamed; others kept (reference)
        requests = list(itertools.islice(requests, limit))
        limit = None

    def source() -> Iterable[Request]:
        return iter_trace(requests, limit) if isinstance(requests, str | Path) else requests

    again = source if hints or conversations else None  # a second reading of the trace
    if router is not None:
        return _run(source(), "", None, opts, ClusterRun(router), again)
    if block_size < 1 or capacity_blocks < 1:
        raise InvalidArgument("block_size and capacity_blocks must be >= 1")
    if nodes:
        with start_cluster(nodes, block_size, capacity_blocks, policy) as local:
            report = _run(source(), "", (block_size, capacity_blocks), opts,
                          ClusterRun(local.router, local), again)
        if reference:
            ref = run_replay(requests, block_size=block_size,
                             capacity_blocks=capacity_blocks * nodes, clients=clients,
                             policy=policy, speed=speed, verify=verify, round_trips=round_trips,
                             prefill_tokens_per_s=prefill_tokens_per_s, num_windows=num_windows,
                             progress=progress, trace_name=trace_name, hints=hints)
            assert report.cluster is not None
            report = replace(report, cluster=replace(
                report.cluster, reference_token_hit_rate=ref.token_hit_rate))
        return report
    if target is not None:
        return _run(source(), target, None, opts, None, again)
    with start_service(block_size, capacity_blocks, policy, sink_fraction, window) as sock:
        return _run(source(), sock, (block_size, capacity_blocks), opts, None, again)


def _run(source: Iterable[Request], target: str, own: tuple[int, int] | None,
         opts: ReplayOptions, cluster: ClusterRun | None = None,
         again: Callable[[], Iterable[Request]] | None = None) -> ReplayReport:
    """Replay `source` against the service at `target`, or a cluster's members (`cluster`)
    (`own`: the block size and capacity of a service or members started for the run, else
    None) from `opts.clients` spawned processes. `again`: the same requests once more, to
    derive hints from when `opts.hints`."""
    from radixkv.client import Client

    notes: list[str] = []
    policy = opts.policy
    if opts.hints:
        policy += " + trace-derived session hints (client-supplied knowledge)"
    kv: Any = ClusterStats(cluster.router) if cluster is not None else Client(target)
    with kv:
        kv.wait_ready()
        window_blocks = 0
        if cluster is not None:
            block_size, capacity, bytes_per_block = kv.geometry()
        else:
            info = kv.pool_info()
            block_size = info.layout.block_size
            capacity = info.handle.num_blocks - info.handle.num_window_blocks
            bytes_per_block = info.layout.bytes_per_block
            window_blocks = info.layout.window_blocks
            if window_blocks:
                notes.append(f"sliding window of {info.layout.sliding_window} tokens: "
                             f"{capacity:,} full parts and {info.handle.num_window_blocks:,} "
                             f"window parts; a resume needs the last {window_blocks} blocks' "
                             "window parts (the optimum and ceiling count full parts only)")
        where = f"the cluster behind router {cluster.router}" if cluster else target
        if own is None:
            prefix = f"replay-{uuid.uuid4().hex[:8]}/"
            notes.append(f"running service at {where}: its block size ({block_size}) and "
                         f"capacity ({capacity:,} blocks) used; namespaces prefixed {prefix!r}")
            policy = f"{policy} (as configured on the server)"
        else:
            prefix = ""
        if opts.verify and bytes_per_block < 8:
            raise InvalidArgument(f"verification needs >= 8 bytes per block, the pool has "
                                  f"{bytes_per_block}; use --no-verify")
        before = kv.stats()
        nodes = kv.num_members if cluster is not None else 1

        ctx = mp.get_context("spawn")
        jobs = ctx.Queue(maxsize=64)
        results = ctx.Queue()
        done = ctx.Value("q", 0)
        start = ctx.Value("d", 0.0)
        barrier = ctx.Barrier(opts.clients + 1)
        args = ClientArgs(target, block_size, capacity, opts.verify, opts.speed,
                          opts.round_trips, router=cluster.router if cluster else "",
                          routing=opts.routing, window_blocks=window_blocks)
        procs = [ctx.Process(target=client_main, args=(args, jobs, results, done, barrier,
                                                        start), daemon=True)
                 for _ in range(opts.clients)]
        for p in procs:
            p.start()
        trace = TraceLog()
        stop = threading.Event()
        hints = trace_hints(again(), block_size) if opts.hints and again is not None else None
        feeder = threading.Thread(target=_feed, args=(source, block_size, prefix, jobs,
                                                      opts.clients, trace, stop, hints),
                                  daemon=True)
        feeder.start()
        try:
            try:
                barrier.wait(timeout=300)
            except threading.BrokenBarrierError:
                pass  # a client failed to start: its error is in the results
            start.value = time.time()  # the clients wait for it: trace time 0
            outs, wall, peak = _collect(kv, procs, results, done, start.value, opts, cluster)
        finally:
            stop.set()
            jobs.cancel_join_thread()  # on an error, unsent jobs must not block our exit
            for p in procs:
                p.join(5)
                if p.is_alive():
                    p.kill()
        feeder.join()
        if trace.error is not None:
            raise trace.error
        held = (_conversations_held(kv, again(), block_size, prefix)
                if opts.conversations and again is not None else None)
        after = kv.stats(check_integrity=own is not None)
    peak = max(peak, int(after["cached_blocks"]))
    run = RunConfig(opts.name, "" if own is not None else where, policy, block_size,
                    capacity * nodes, opts.clients, opts.speed, opts.verify,
                    opts.prefill_tokens_per_s, opts.num_windows, prefix, opts.round_trips)
    report = build_report(run, trace, outs, wall, before, after, peak, notes)
    if held is not None:
        report = replace(report, conversations=held[0], conversations_held=held[1])
    if window_blocks:
        report = replace(report, window_parts=int(after["window_blocks"]))
    if cluster is None:
        return report
    counts: dict[str, int] = {}
    for o in outs:
        for i in o["node"].tolist():
            name = o["node_names"][i]
            counts[name] = counts.get(name, 0) + 1
    route = np.concatenate([o["route_ns"] for o in outs])
    return replace(report, cluster=Cluster(
        nodes, opts.routing, cluster.router, capacity, tuple(sorted(counts.items())),
        Cluster.imbalance(list(counts.values())), Latency.of(route[route >= 0] / 1e3),
        tuple(cluster.killed)))


def _conversations_held(kv: Any, requests: Iterable[Request], block_size: int,
                        prefix: str) -> tuple[int, int]:
    """(conversations, how many are still cached whole): a conversation is a chain of prompts
    each extending the last (radixkv.replay.hints), counted by its last prompt; it is held when
    a Match resumes that prompt's every full block. The matches' leases end at once."""
    reqs = [r for r in requests if r.num_tokens >= block_size]
    ends = [r for r, h in zip(reqs, trace_hints(reqs, block_size), strict=True)
            if h == "session_end"]
    held = 0
    for start in range(0, len(ends), 256):
        batch = ends[start:start + 256]
        found = kv.match_many([(prefix + r.namespace, r.tokens) for r in batch])
        kv.release(*[m.lease_id for m in found])
        held += sum(m.num_tokens == r.num_tokens // block_size * block_size
                    for m, r in zip(found, batch, strict=True))
    return len(ends), held


def _collect(kv: Any, procs: list[Any], results: Any, done: Any, t0: float,
             opts: ReplayOptions,
             cluster: ClusterRun | None = None) -> tuple[list[dict[str, Any]], float, int]:
    """Wait for every client's result, sampling the cache's peak occupancy and driving the
    progress bar. Returns (results, wall seconds, peak cached blocks)."""
    outs: list[dict[str, Any]] = []
    peak = 0
    bar = _progress(opts.progress, opts.total)
    next_poll = 0.0
    while len(outs) < opts.clients:
        try:
            outs.append(results.get(timeout=0.1))
            if "error" in outs[-1]:
                raise RadixKVError("a replay client failed:\n" + outs[-1]["error"])
        except queue.Empty:
            if all(not p.is_alive() for p in procs) and results.empty():
                raise RadixKVError("replay clients exited without a result") from None
        if (cluster is not None and cluster.local is not None and not cluster.killed
                and opts.kill_member_after is not None and done.value >= opts.kill_member_after):
            victim = sorted(cluster.local.members)[0]
            cluster.local.members[victim].stop(signal.SIGKILL)  # a crash, mid-replay
            cluster.killed.append(victim)
        if time.monotonic() >= next_poll:  # peak occupancy, sampled
            peak = max(peak, int(kv.stats()["cached_blocks"]))
            next_poll = time.monotonic() + 0.25
        if bar is not None:
            bar[0].update(bar[1], completed=done.value)
    if bar is not None:
        bar[0].update(bar[1], completed=done.value)
        bar[0].stop()
    return outs, max(o["finished"] for o in outs) - t0, peak


def _progress(enabled: bool, total: int | None) -> tuple[Any, Any] | None:
    if not enabled:
        return None
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    bar = Progress(TextColumn("replay"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TimeRemainingColumn(), console=Console(stderr=True), transient=True)
    bar.start()
    return bar, bar.add_task("replay", total=total)


# ---- command line --------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `radixkv replay` flags."""
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
    p.add_argument("--kv-dtype", default="bf16", choices=("bf16", "int8", "int4"),
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
    p.add_argument("--kv-sink-fraction", type=float, default=0.125,
                   help="int8/int4: the share of sink blocks (a sequence's first block), as "
                   "`radixkv serve` (0.125)")
    p.add_argument("--policy", default=DEFAULT_POLICY, choices=EVICTION_POLICIES,
                   help=f"eviction policy of the started service (default {DEFAULT_POLICY})")
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
    g = p.add_argument_group("cluster (radixkv/replay/routing.py)")
    g.add_argument("--nodes", type=int, default=0, metavar="N",
                   help="start etcd, N members of --capacity-blocks each and a router, and "
                   "replay over them (0, default: one service)")
    g.add_argument("--router", default=None, metavar="ADDR",
                   help="replay over a running cluster through this router instead")
    g.add_argument("--routing", default="cache-aware",
                   choices=("cache-aware", "session", "round-robin", "random"),
                   help="how each request's member is chosen (cache-aware: the router's Route)")
    g.add_argument("--kill-member-after", type=int, default=None, metavar="REQUESTS",
                   help="SIGKILL one member (with --nodes) once this many requests are done")
    g.add_argument("--reference", action="store_true",
                   help="also replay on one node of N x --capacity-blocks (with --nodes) and "
                   "report the cluster's hit rate against it")
    p.add_argument("--no-verify", action="store_true",
                   help="do not write and check block bytes (on by default)")
    p.add_argument("--prefill-tokens-per-s", type=float, default=DEFAULT_PREFILL_TOKENS_PER_S,
                   help="prefill rate to turn saved tokens into TTFT (default 10,000: an "
                   "assumed 70B-class rate, see radixkv/replay/runner.py; give your engine's)")
    p.add_argument("--windows", type=int, default=40, help="hit-rate-over-time windows (40)")
    p.add_argument("--plots", metavar="DIR", help="write PNG plots here")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


@dataclass(frozen=True, slots=True)
class MemoryCapacity:
    """What a `radixkv serve --memory` pool of one layout holds."""

    blocks: int  # the replayed service's capacity: blocks, or a windowed pool's full parts
    sink_fraction: float
    window_blocks: int = 0  # a sliding-window pool's window parts
    note: str = ""  # for the report: how a windowed pool's memory splits
    window: ReplayWindow | None = None  # the replayed service's window (windowed presets)


def memory_capacity(preset: str, kv_dtype: str, block_size: int, memory: str,
                    sink_fraction: float, window_fraction: float | None = None,
                    all_full: bool = False) -> MemoryCapacity:
    """The blocks of `preset`'s layout stored as `kv_dtype` in `memory` bytes: what a
    `radixkv serve --memory` pool of that format holds. A sliding-window preset's pool holds
    full parts and window parts (gpu_pool.sizing.fit_window_blocks, `window_fraction` or the
    default; quantized without sink tokens, as such a pool must be): the replay gets the full
    parts as its blocks beside the window parts (`window`). `all_full`: count the preset as if
    every layer were full attention (the baseline a window-unaware cache is)."""
    from gpu_pool.layout import KVLayout, parse_bytes
    from gpu_pool.sizing import default_window_fraction, fit_blocks, fit_window_blocks

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


def main(args: argparse.Namespace) -> int:
    """Run `radixkv replay` from parsed flags."""
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
        trace_name=args.trace, nodes=args.nodes, router=args.router, routing=args.routing,
        kill_member_after=args.kill_member_after, reference=args.reference, hints=args.hints,
        window=window, conversations=args.conversations)
    if note:
        report = replace(report, notes=(*report.notes, note))
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
