"""What `radixkv replay` reports: the frozen ReplayReport, how it is built from the client
processes' per-request records and the offline optimum (radixkv.replay.optimum), and its rich
rendering (its plots: plots.py). Nothing here talks to the service.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from radixkv.replay.disk import DiskFigures
from radixkv.replay.optimum import belady, ceiling


@dataclass(frozen=True, slots=True)
class Latency:
    """Client-side round-trip times in microseconds."""

    count: int
    mean: float
    p50: float
    p99: float
    p999: float

    @classmethod
    def of(cls, us: Sequence[float] | np.ndarray[Any, Any]) -> Latency:
        a = np.asarray(us, dtype=np.float64)
        if not a.size:
            return cls(0, 0.0, 0.0, 0.0, 0.0)
        p50, p99, p999 = np.percentile(a, [50, 99, 99.9])
        return cls(int(a.size), float(a.mean()), float(p50), float(p99), float(p999))


@dataclass(frozen=True, slots=True)
class Window:
    """A run of consecutive requests (trace order) and its token hit rates."""

    first_request: int
    num_requests: int
    start_ms: float | None  # trace timestamp of the first request, if the trace has them
    token_hit_rate: float  # the service replay
    optimum_hit_rate: float
    ceiling_hit_rate: float


@dataclass(frozen=True, slots=True)
class Cluster:
    """What a replay over a cluster adds: the routing, how the requests spread, Route's time."""

    nodes: int  # members at the start
    routing: str  # cache-aware | session | round-robin | random
    router: str
    capacity_blocks_per_node: int
    requests_per_node: tuple[tuple[str, int], ...]  # node id, requests it completed
    load_imbalance: float  # max / mean requests per member (members that served any)
    route_us: Latency  # the client's Route call (cache-aware only)
    killed: tuple[str, ...] = ()  # members SIGKILLed during the run
    reference_token_hit_rate: float | None = None  # the trace on one node of nodes x capacity
    # peer fetch (--peer-fetch): blocks and bytes members pulled from each other, fetch p50
    peer_fetched_blocks: int | None = None
    peer_fetch_bytes: int | None = None
    peer_fetch_p50_ms: float | None = None

    @staticmethod
    def imbalance(counts: Sequence[int]) -> float:
        live = [c for c in counts if c]
        return max(live) / (sum(live) / len(live)) if live else 0.0


@dataclass(frozen=True, slots=True)
class ReplayReport:
    trace: str
    target: str  # "" when the replay started its own service
    policy: str
    block_size: int
    capacity_blocks: int
    clients: int
    speed: float  # 0: as fast as possible
    verify: bool
    round_trips: int  # 2: Match allocates, Insert releases; 4: Match, Allocate, Insert, Release
    num_requests: int
    prompt_tokens: int
    cacheable_tokens: int  # prompt tokens in full blocks
    hit_tokens: int
    token_hit_rate: float  # hit_tokens / prompt_tokens
    optimum_hit_tokens: int  # Belady (MIN) at the same capacity
    optimum_token_hit_rate: float
    ceiling_hit_tokens: int  # infinite capacity
    ceiling_token_hit_rate: float
    server_hit_tokens: int  # the service's own count for the replay's namespaces
    wall_s: float
    requests_per_s: float
    match_us: Latency
    allocate_us: Latency
    insert_us: Latency
    release_us: Latency
    evicted_blocks: int
    optimum_evicted_blocks: int
    dropped_blocks: int  # new blocks not cached: nothing left to evict (pinned or leased)
    peak_cached_blocks: int  # sampled from Stats while running, and at the end
    verified_blocks: int  # hit blocks whose bytes were checked
    mismatches: int  # ... and found wrong (must be 0)
    mismatch_examples: tuple[str, ...]
    integrity: str  # the service's invariant check at the end ("ok"), "" if not run
    prefill_tokens_per_s: float
    windows: tuple[Window, ...]
    notes: tuple[str, ...] = ()
    match_samples_us: tuple[float, ...] = field(default=(), repr=False)
    insert_samples_us: tuple[float, ...] = field(default=(), repr=False)
    per_request_hit_tokens: tuple[int, ...] = field(default=(), repr=False)  # trace order
    cluster: Cluster | None = None  # a replay over a cluster's members, through a router
    window_parts: int = 0  # a sliding-window pool's window parts (capacity_blocks: full parts)
    conversations: int = 0  # with conversations counted: chains of prompts in the trace
    conversations_held: int = 0  # ... whose last prompt is cached whole at the end
    disk: DiskFigures | None = None  # the service's disk tier, if it has one
    # with peek: blocks the lookup table gave, and of them those the Match then did not find
    peeked_blocks: int = 0
    pin_missed_blocks: int = 0

    # prefill saved: every hit token is one the engine does not recompute
    @property
    def ttft_saved_s(self) -> float:
        """Prefill seconds saved over the whole trace at `prefill_tokens_per_s`."""
        return self.hit_tokens / self.prefill_tokens_per_s

    @property
    def mean_ttft_ms(self) -> tuple[float, float, float]:
        """Mean prefill time per request without a cache, with this replay's hits, with the
        optimum's (ms; prefill only, no queueing or decode)."""
        n, rate = max(1, self.num_requests), self.prefill_tokens_per_s
        return (
            1e3 * self.prompt_tokens / n / rate,
            1e3 * (self.prompt_tokens - self.hit_tokens) / n / rate,
            1e3 * (self.prompt_tokens - self.optimum_hit_tokens) / n / rate,
        )

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.repr}
        for key in ("match_us", "allocate_us", "insert_us", "release_us"):
            out[key] = asdict(out[key])
        out["match_p50_us"] = self.match_us.p50
        if self.cluster is not None:
            c = self.cluster
            out["cluster"] = asdict(c)
            out.update(nodes=c.nodes, routing=c.routing, load_imbalance=c.load_imbalance,
                       route_p50_us=c.route_us.p50, route_p99_us=c.route_us.p99,
                       requests_per_node=dict(c.requests_per_node),
                       reference_token_hit_rate=c.reference_token_hit_rate,
                       peer_fetched_blocks=c.peer_fetched_blocks,
                       peer_fetch_bytes=c.peer_fetch_bytes, peer_fetch_p50_ms=c.peer_fetch_p50_ms,
                       hit_rate_vs_reference=(self.token_hit_rate / c.reference_token_hit_rate
                                              if c.reference_token_hit_rate else None))
        out["windows"] = [asdict(w) for w in self.windows]
        out["mismatch_examples"] = list(self.mismatch_examples)
        out["verify_mismatches"] = self.mismatches

        out["notes"] = list(self.notes)
        no_cache, cached, optimum = self.mean_ttft_ms
        out["prefill_saved"] = {
            "tokens": self.hit_tokens,
            "seconds_at_rate": self.ttft_saved_s,
            "mean_ttft_ms_no_cache": no_cache,
            "mean_ttft_ms": cached,
            "mean_ttft_ms_optimum": optimum,
        }
        if self.disk is not None:
            self.disk.add_to(out, self.hit_tokens, self.prompt_tokens, self.ttft_saved_s)
        return out


def make_windows(
    prompt_tokens: np.ndarray[Any, Any],
    hits: Sequence[np.ndarray[Any, Any]],  # replay, optimum, ceiling: hit tokens per request
    timestamps_ms: Sequence[float | None],
    num_windows: int,
) -> tuple[Window, ...]:
    """Cut the requests (trace order) into about `num_windows` runs of equal length."""
    n = len(prompt_tokens)
    if not n:
        return ()
    size = max(1, -(-n // max(1, num_windows)))
    out = []
    for lo in range(0, n, size):
        hi = min(n, lo + size)
        total = int(prompt_tokens[lo:hi].sum()) or 1
        rates = [int(h[lo:hi].sum()) / total for h in hits]
        out.append(Window(lo, hi - lo, timestamps_ms[lo], rates[0], rates[1], rates[2]))
    return tuple(out)


@dataclass
class TraceLog:
    """What the feeder saw, in trace order (filled while the replay runs)."""

    prompt_tokens: list[int] = field(default_factory=list)
    timestamps_ms: list[float | None] = field(default_factory=list)  # from the first request
    keys: list[list[int]] = field(default_factory=list)  # block_keys() per request
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class RunConfig:
    trace: str
    target: str  # "" for a service started for the run
    policy: str
    block_size: int
    capacity_blocks: int
    clients: int
    speed: float
    verify: bool
    prefill_tokens_per_s: float
    num_windows: int
    namespace_prefix: str
    round_trips: int = 2


def build_report(run: RunConfig, trace: TraceLog, outs: list[dict[str, Any]], wall: float,
                 before: dict[str, Any], after: dict[str, Any], peak: int,
                 notes: list[str]) -> ReplayReport:
    """Merge the clients' records (radixkv.replay.client) into trace order, run the optimum and
    the ceiling over the same block keys, and summarize. `before` / `after`: Stats dicts."""
    block_size, capacity, prefix = run.block_size, run.capacity_blocks, run.namespace_prefix
    n = len(trace.prompt_tokens)
    col = {k: np.concatenate([o[k] for o in outs]) for k in outs[0] if k != "examples"
           and isinstance(outs[0][k], np.ndarray)}
    order = np.argsort(col["index"], kind="stable")
    col = {k: v[order] for k, v in col.items()}
    assert col["index"].tolist() == list(range(n)), "every request is replayed exactly once"
    prompt = np.asarray(trace.prompt_tokens, dtype=np.int64)
    hits = col["hit_tokens"]
    opt = belady(trace.keys, capacity)
    ceil = ceiling(trace.keys)
    opt_hits = np.asarray(opt.per_request_hit_blocks, dtype=np.int64) * block_size
    ceil_hits = np.asarray(ceil.per_request_hit_blocks, dtype=np.int64) * block_size
    prompt_tokens = int(prompt.sum())

    def rate_of(h: int) -> float:
        return h / prompt_tokens if prompt_tokens else 0.0

    def us(key: str) -> np.ndarray[Any, Any]:
        v = col[key]
        return v[v >= 0] / 1e3

    ours = [ns for ns in after["namespaces"] if ns["namespace"].startswith(prefix)]
    server_hits = sum(ns["hit_tokens"] for ns in ours)
    if not run.target:  # own service: nothing else ran on it
        server_hits -= sum(ns["hit_tokens"] for ns in before["namespaces"])
    if run.clients > 1:
        notes.append("with several clients, requests overlap and the hit rate may differ "
                     "slightly from a serial replay (equality with replay_tree holds for 1)")
    return ReplayReport(
        trace=run.trace, target=run.target, policy=run.policy, block_size=block_size,
        capacity_blocks=capacity, clients=run.clients, speed=run.speed, verify=run.verify,
        round_trips=run.round_trips, num_requests=n, prompt_tokens=prompt_tokens,
        cacheable_tokens=opt.num_blocks * block_size,
        hit_tokens=int(hits.sum()), token_hit_rate=rate_of(int(hits.sum())),
        optimum_hit_tokens=int(opt_hits.sum()), optimum_token_hit_rate=rate_of(
            int(opt_hits.sum())),
        ceiling_hit_tokens=int(ceil_hits.sum()), ceiling_token_hit_rate=rate_of(
            int(ceil_hits.sum())),
        server_hit_tokens=int(server_hits), wall_s=wall,
        requests_per_s=n / wall if wall > 0 else 0.0,
        match_us=Latency.of(us("match_ns")), allocate_us=Latency.of(us("allocate_ns")),
        insert_us=Latency.of(us("insert_ns")), release_us=Latency.of(us("release_ns")),
        evicted_blocks=int(after["evicted_blocks"] - before["evicted_blocks"]),
        optimum_evicted_blocks=opt.num_evicted_blocks,
        dropped_blocks=int(col["dropped"].sum()), peak_cached_blocks=peak,
        peeked_blocks=int(col["peek_blocks"].sum()),
        pin_missed_blocks=pin_misses(col["peek_blocks"], hits // block_size),
        verified_blocks=sum(o["verified"] for o in outs),
        mismatches=sum(o["mismatches"] for o in outs),
        mismatch_examples=tuple(e for o in outs for e in o["examples"])[:5],
        integrity=str(after.get("integrity", "")), prefill_tokens_per_s=run.prefill_tokens_per_s,
        windows=make_windows(prompt, (hits, opt_hits, ceil_hits), trace.timestamps_ms,
                             run.num_windows),
        notes=tuple(notes), match_samples_us=tuple(us("match_ns").tolist()),
        insert_samples_us=tuple(us("insert_ns").tolist()),
        per_request_hit_tokens=tuple(hits.tolist()),
    )


def pin_misses(peeked: np.ndarray[Any, Any], hit_blocks: np.ndarray[Any, Any]) -> int:
    """Of the blocks the lookup table gave before each Match, those the Match then did not
    find (evicted in between: a pin miss)."""
    return int(np.maximum(peeked - hit_blocks, 0).sum())


def _tier_rows(head: Any, r: ReplayReport) -> None:
    """The disk tier's row and the lookup table's, where the run had them."""
    if r.disk is not None:
        head.add_row("tiers", r.disk.line(r.hit_tokens, r.prompt_tokens))
    if r.peeked_blocks:
        head.add_row("lookup table", f"{r.peeked_blocks:,} blocks read before the Matches, "
                     f"{r.pin_missed_blocks:,} of them gone by the Match "
                     f"({100 * r.pin_missed_blocks / r.peeked_blocks:.3f} %)")


def render_report(report: ReplayReport) -> Any:
    """A rich renderable for humans."""
    from rich.console import Group
    from rich.table import Table

    r = report
    head = Table(title=f"radixkv replay: {r.trace}", show_header=False, title_justify="left")
    head.add_column(style="bold")
    head.add_column()
    where = r.target or ("own cluster (started for this run), capacity summed" if r.cluster
                         else "own service (started for this run)")
    head.add_row("service", f"{where}; policy {r.policy}, {r.capacity_blocks:,} blocks x "
                 f"{r.block_size} tokens")
    speed = f"timestamps / {r.speed:g}" if r.speed else "as fast as possible"
    head.add_row("load", f"{r.num_requests:,} requests, {r.prompt_tokens:,} prompt tokens, "
                 f"{r.clients} client processes, {speed}")
    head.add_row("throughput", f"{r.requests_per_s:,.0f} requests/s ({r.wall_s:.1f} s)")
    head.add_row("cache", f"{r.evicted_blocks:,} blocks evicted, peak {r.peak_cached_blocks:,}"
                 f" cached, {r.dropped_blocks:,} not cached for lack of room")
    if r.window_parts:
        head.add_row("window", f"{r.window_parts:,} window parts beside the "
                     f"{r.capacity_blocks:,} full parts")
    if r.conversations:
        head.add_row("conversations", f"{r.conversations_held:,} of {r.conversations:,} held "
                     "whole at the end (their last prompt resumable)")
    _tier_rows(head, r)
    verdict = ("[green]0 mismatches[/]" if not r.mismatches else
               f"[bold red]{r.mismatches:,} MISMATCHES[/]")
    head.add_row("verification", f"{r.verified_blocks:,} hit blocks checked: {verdict}"
                 if r.verify else "off (--no-verify)")
    if r.integrity:
        head.add_row("integrity", r.integrity)
    if r.cluster is not None:
        c = r.cluster
        spread = ", ".join(f"{n} {k:,}" for n, k in c.requests_per_node)
        head.add_row("cluster", f"{c.nodes} members x {c.capacity_blocks_per_node:,} blocks, "
                     f"routing {c.routing} via {c.router}")
        head.add_row("spread", f"requests per member: {spread} (max/mean "
                     f"{c.load_imbalance:.2f})" + (f"; killed {', '.join(c.killed)}"
                                                    if c.killed else ""))
        if c.route_us.count:
            head.add_row("Route", f"p50 {c.route_us.p50:,.0f} us, p99 {c.route_us.p99:,.0f} us "
                         f"(Match p50 {r.match_us.p50:,.0f} us)")
        if c.reference_token_hit_rate is not None:
            ref = c.reference_token_hit_rate
            head.add_row("reference", f"one node of {r.capacity_blocks:,} blocks: {ref:.2%} "
                         f"(this run {r.token_hit_rate / ref:.3f}x)" if ref else "")

    hits = Table(title="token hit rate", title_justify="left")
    for col in ("", "hit rate", "hit tokens", "evicted blocks", "mean prefill / request"):
        hits.add_column(col, justify="right" if col else "left")
    no_cache, cached, optimum = r.mean_ttft_ms
    hits.add_row(f"this replay ({r.policy})", f"[bold]{r.token_hit_rate:.2%}[/]",
                 f"{r.hit_tokens:,}", f"{r.evicted_blocks:,}", f"{cached:,.0f} ms")
    hits.add_row("offline optimum (Belady)", f"{r.optimum_token_hit_rate:.2%}",
                 f"{r.optimum_hit_tokens:,}", f"{r.optimum_evicted_blocks:,}",
                 f"{optimum:,.0f} ms")
    hits.add_row("infinite capacity", f"{r.ceiling_token_hit_rate:.2%}",
                 f"{r.ceiling_hit_tokens:,}", "0", "")
    hits.add_row("no cache", "0%", "0", "", f"{no_cache:,.0f} ms")
    hits.caption = (f"prefill saved: {r.hit_tokens:,} tokens = {r.ttft_saved_s:,.0f} s of "
                    f"prefill at {r.prefill_tokens_per_s:,.0f} tokens/s "
                    "(--prefill-tokens-per-s)")

    lat = Table(title="client round trip (us)", title_justify="left")
    for col in ("call", "count", "p50", "p99", "p99.9", "mean"):
        lat.add_column(col, justify="left" if col == "call" else "right")
    for name, x in (("Match", r.match_us), ("Allocate", r.allocate_us),
                    ("Insert", r.insert_us), ("Release", r.release_us)):
        lat.add_row(name, f"{x.count:,}", f"{x.p50:,.0f}", f"{x.p99:,.0f}", f"{x.p999:,.0f}",
                    f"{x.mean:,.0f}")
    parts: list[Any] = [head, hits, lat]
    parts += [f"[yellow]note:[/] {n}" for n in r.notes]
    return Group(*parts)

