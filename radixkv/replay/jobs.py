"""The replay's plumbing between the run and its client processes: the feeder that turns the
trace into jobs (block keys, due times, hints) on one queue, the collector that waits for every
client's result while it samples the cache and drives the progress bar, and the conversations
count at the end."""

from __future__ import annotations

import queue
import signal
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixkv.protocol.errors import RadixKVError
from radixkv.replay.client import block_keys
from radixkv.replay.cluster import ClusterRun
from radixkv.replay.hints import trace_hints
from radixkv.replay.report import TraceLog
from radixkv.replay.workload import Request


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


def feed(requests: Iterable[Request], block_size: int, prefix: str, jobs: Any, clients: int,
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


def count_requests(source: Iterable[Request] | str | Path, limit: int | None) -> int | None:
    if isinstance(source, list | tuple):
        n = len(source)
    elif isinstance(source, str | Path):
        with open(source, "rb") as f:
            n = sum(1 for line in f if line.strip())
    else:
        return limit
    return n if limit is None else min(n, limit)


def conversations_held(kv: Any, requests: Iterable[Request], block_size: int,
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


def collect(kv: Any, procs: list[Any], results: Any, done: Any, t0: float,
             opts: ReplayOptions,
             cluster: ClusterRun | None = None) -> tuple[list[dict[str, Any]], float, int]:
    """Wait for every client's result, sampling the cache's peak occupancy and driving the
    progress bar. Returns (results, wall seconds, peak cached blocks)."""
    outs: list[dict[str, Any]] = []
    peak = 0
    bar = progress_bar(opts.progress, opts.total)
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


def progress_bar(enabled: bool, total: int | None) -> tuple[Any, Any] | None:
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
