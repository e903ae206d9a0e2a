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

Over a cluster (`started` starts etcd, members and a router; `router` names a running one),
each client sends each request to the member radixkv.replay.routing picks; the Stats figures
are summed over the members (radixkv.replay.cluster), the optimum and the ceiling are those of
one node of the members' capacity summed, and the report adds the spread and Route's time.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing as mp
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from radixkv.index.policies import DEFAULT_POLICY
from radixkv.protocol.errors import InvalidArgument
from radixkv.replay.client import ClientArgs, block_keys
from radixkv.replay.cluster import (
    ClusterRun,
    ClusterStats,
    ReplayWindow,
    StartedCluster,
    peer_figures,
    service_flags,
    start_cluster,
)
from radixkv.replay.disk import DiskFigures
from radixkv.replay.hints import trace_hints
from radixkv.replay.jobs import ReplayOptions, collect, conversations_held, count_requests, feed
from radixkv.replay.report import (
    Cluster,
    Latency,
    ReplayReport,
    RunConfig,
    TraceLog,
    build_report,
    render_report,
)
from radixkv.replay.sender import client_main
from radixkv.replay.workload import Request, iter_trace
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
    disk: tuple[str, int] | None = None,
) -> Iterator[str]:
    """Run `radixkv serve` with a tiny layout on a temporary socket; yield the socket path.
    `sink_fraction` > 0 gives the pool a sink region of that share, as a quantized pool with
    sink tokens has (the tiny layout then stores int8). SIGTERM at exit."""
    with tempfile.TemporaryDirectory(prefix="rkv-replay-") as directory:
        flags = service_flags(directory, block_size, capacity_blocks, policy, sink_fraction,
                              window)
        if disk is not None:  # (directory or "" for a temporary one, blocks)
            disk_dir = disk[0] or os.path.join(directory, "disk")
            os.makedirs(disk_dir, exist_ok=True)
            flags += ("--disk-dir", disk_dir, "--disk-capacity-blocks", str(disk[1]))
        with server_process(*flags) as server:
            yield server.socket


# ---- the run -------------------------------------------------------------------------------


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
    started: StartedCluster | None = None,
    router: str | None = None,
    routing: str = "cache-aware",
    hints: bool = False,
    window: ReplayWindow | None = None,
    conversations: bool = False,
    disk: tuple[str, int] | None = None,
) -> ReplayReport:
    """Replay `requests` (Requests, or a Mooncake / token JSONL path, streamed) against the
    service at `target`, or against one started for the run with `block_size`,
    `capacity_blocks` and `policy`; see the module docstring. `speed` > 0 follows the trace
    timestamps divided by it; 0 sends as fast as the clients go.

    A cluster: `started` starts etcd, its `nodes` members of `capacity_blocks` each and a
    router (`router`: use a running cluster's router instead); each request goes to the member
    `routing` picks (radixkv.replay.routing); radixkv.replay.cluster.StartedCluster says what
    else (a member killed, the one-node reference, peer fetch). `hints`:
    send each request's retention hint derived from the trace's future (client-supplied
    knowledge; one extra pass over the trace first). `window`: the started service caches a
    sliding-window model (capacity_blocks full parts beside window.window_parts window parts;
    two round trips only). `conversations`: at the end, count the conversations whose last
    prompt is still cached whole (ReplayReport.conversations_held; one more pass over the
    trace). `disk`: the started service gets a disk tier (its directory, "" for a temporary
    one, and its capacity in blocks; radixkv/disk/)."""
    if clients < 1:
        raise InvalidArgument(f"clients must be >= 1, got {clients}")
    if round_trips not in (2, 4):
        raise InvalidArgument(f"round_trips must be 2 or 4, got {round_trips}")
    nodes = started.nodes if started is not None else 0
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
    if nodes < 0 or (started is not None and started.kill_member_after is not None
                     and not nodes):
        raise InvalidArgument("nodes must be >= 0; kill_member_after needs a cluster started "
                              "here (nodes > 0)")
    opts = ReplayOptions(
        trace_name or (str(requests) if isinstance(requests, str | Path) else "requests"),
        clients, policy, speed, verify, prefill_tokens_per_s, num_windows, progress,
        count_requests(requests, limit), round_trips, routing,
        started.kill_member_after if started is not None else None, hints,
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
    if started is not None and nodes:
        with start_cluster(started, block_size, capacity_blocks, policy) as local:
            report = _run(source(), "", (block_size, capacity_blocks), opts,
                          ClusterRun(local.router, local, peer_fetch=started.peer_fetch), again)
        if started.reference:
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
    if disk is not None and (nodes or window):
        raise InvalidArgument("a disk tier replay runs on one full-attention service")
    with start_service(block_size, capacity_blocks, policy, sink_fraction, window,
                       disk) as sock:
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
        feeder = threading.Thread(target=feed, args=(source, block_size, prefix, jobs,
                                                      opts.clients, trace, stop, hints),
                                  daemon=True)
        feeder.start()
        try:
            try:
                barrier.wait(timeout=300)
            except threading.BrokenBarrierError:
                pass  # a client failed to start: its error is in the results
            start.value = time.time()  # the clients wait for it: trace time 0
            outs, wall, peak = collect(kv, procs, results, done, start.value, opts, cluster)
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
        held = (conversations_held(kv, again(), block_size, prefix)
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
    d0, d1 = before.get("disk") or {}, after.get("disk") or {}
    if d1.get("capacity_blocks"):
        report = replace(report, disk=DiskFigures(
            int(d1["capacity_blocks"]), *(int(d1[k]) - int(d0.get(k, 0)) for k in (
                "hit_tokens", "demoted_blocks", "promoted_blocks", "evicted_blocks",
                "verify_failures"))))
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
        tuple(cluster.killed), **peer_figures(before, after, cluster.peer_fetch)))
