"""DumpTree under the service lock: the whole tree at once against pages after a cursor, and
what a Match waits while a router's follower reads the tree page after page.

    python bench/dump_pages.py [--nodes 200000] [--page 1024] [--matches 3000] [--json]

Builds a KVService (host pool, block size 4) holding `--nodes` nodes: half of them prompts of
their own under the root (a wide root: the worst case for a cursor, which must find its place
among all of them), half a second block under one of those. Times, in process:

- `dump_tree` (the whole tree, one hold of the lock) and `dump_page` for a page at the start,
  the middle and the end of the tree (the median of 5 each), and the longest single hold of the
  service lock while a whole tree is read in pages (`page_longest_hold_ms`);
- Match latency (p50, p99, max over `--matches` Matches of a cached prompt, one thread) alone,
  beside a thread that only burns CPU (the GIL's own floor: `busy_*`), and beside a thread
  reading the whole tree in pages over and over (`paging_*`); `paging_p99_vs_busy` is the
  ratio of the last two.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

from kvpool import create_pool
from kvpool.layout import KVLayout
from radixkv.protocol.tokens import to_token_bytes
from radixkv.protocol.values import InsertItem
from radixkv.service import KVService, ServiceConfig

BS = 4


def build(num_nodes: int) -> KVService:
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="fp16", block_size=BS)
    svc = KVService(create_pool(layout, 2 * num_nodes + 16, backend="host"),
                    ServiceConfig(max_namespaces=4, lease_ttl_s=3600))
    heads = num_nodes // 2
    for blocks, count in ((1, heads), (2, num_nodes - heads)):  # heads, then a child each
        for start in range(0, count, 512):
            items = []
            for h in range(start, min(count, start + 512)):
                tokens = to_token_bytes([h] * BS + [h + 1] * BS * (blocks - 1))
                a = svc.allocate("bench", None, "ns", blocks)
                items.append(InsertItem(a.lease_id, "ns", tokens, a.block_ids))
            svc.insert_many("bench", items, release=[i.lease_id for i in items])
    return svc


class TimedLock:
    """The service lock, timing each outermost hold of it (the service's lock is reentrant)."""

    def __init__(self, lock) -> None:  # type: ignore[no-untyped-def]
        self.lock, self.depth, self.holds = lock, 0, []
        self.since = 0.0

    def __enter__(self) -> None:
        self.lock.__enter__()
        self.depth += 1
        if self.depth == 1:
            self.since = time.perf_counter()

    def __exit__(self, *exc) -> None:  # type: ignore[no-untyped-def]
        if self.depth == 1:
            self.holds.append(time.perf_counter() - self.since)
        self.depth -= 1
        self.lock.__exit__(*exc)


def read_all(svc: KVService, page_size: int) -> int:
    cursor, pages = b"", 0
    while True:
        cursor = svc.dump_page("ns", cursor, page_size).next_cursor
        pages += 1
        if not cursor:
            return pages


def match_latency(svc: KVService, count: int, beside=None) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """p50 / p99 / max of `count` Matches (ms), with `beside` running in a thread meanwhile."""
    stop = threading.Event()
    worker = None
    if beside is not None:
        worker = threading.Thread(target=lambda: [beside() for _ in iter(stop.is_set, True)])
        worker.start()
        time.sleep(0.05)
    times = []
    for i in range(count):
        tokens = to_token_bytes([i % 1000] * BS)
        t = time.perf_counter()
        m = svc.match("bench", "ns", tokens)
        times.append(time.perf_counter() - t)
        svc.release("bench", [m.lease_id])
    stop.set()
    if worker is not None:
        worker.join()
    times.sort()
    return {"p50_ms": times[len(times) // 2] * 1e3, "p99_ms": times[int(len(times) * 0.99)] * 1e3,
            "max_ms": times[-1] * 1e3}


def busy() -> None:
    sum(range(20_000))


def median_ms(fn, repeat: int = 5) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=200_000)
    p.add_argument("--page", type=int, default=1024)
    p.add_argument("--matches", type=int, default=3000, help="Matches timed in each case")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    svc = build(args.nodes)
    nodes, _ = svc.dump_tree("ns")
    cursors = {"first": b""}
    page = svc.dump_page("ns", b"", args.page)
    pages = 1
    cursor = page.next_cursor
    while cursor:  # walk every page once: the count, and cursors in the middle and at the end
        page = svc.dump_page("ns", cursor, args.page)
        pages += 1
        if pages == (len(nodes) // args.page) // 2:
            cursors["middle"] = cursor
        if page.next_cursor:
            cursors["last"] = cursor
        cursor = page.next_cursor
    out = {"nodes": len(nodes), "page_size": args.page, "pages": pages,
           "whole_tree_ms": median_ms(lambda: svc.dump_tree("ns"))}
    for name, c in cursors.items():
        out[f"page_{name}_ms"] = median_ms(lambda c=c: svc.dump_page("ns", c, args.page))
    timed = TimedLock(svc._lock)  # the bench looks inside: what the service holds it for
    svc._lock = timed  # type: ignore[assignment]
    read_all(svc, args.page)
    out["page_longest_hold_ms"] = max(timed.holds) * 1e3
    svc._lock = timed.lock
    for name, beside in (("alone", None), ("busy", busy),
                         ("paging", lambda: read_all(svc, args.page))):
        for k, v in match_latency(svc, args.matches, beside).items():
            out[f"{name}_{k}"] = v
    out["paging_p99_vs_busy"] = out["paging_p99_ms"] / out["busy_p99_ms"]
    svc.pool.close()
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:>20}: {v:.2f}" if isinstance(v, float) else f"{k:>20}: {v}")


if __name__ == "__main__":
    main()
