"""DumpTree under the service lock: the whole tree at once against one page after a cursor.

    python bench/dump_pages.py [--nodes 200000] [--page 1024] [--json]

Builds a KVService (host pool, block size 4) holding `--nodes` nodes: half of them prompts of
their own under the root (a wide root: the worst case for a cursor, which must find its place
among all of them), half a second block under one of those. Times, in process, what the
service does under its lock: `dump_tree` (the whole tree) and `dump_page` for a page at the
start, the middle and the end of the tree (the median of 5 each).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from gpu_pool import create_pool
from gpu_pool.layout import KVLayout
from radixkv.service import KVService, ServiceConfig
from radixkv.tokens import to_token_bytes

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
                items.append((a.lease_id, "ns", tokens, a.block_ids))
            svc.insert_many("bench", items, release=[i[0] for i in items])
    return svc


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
    svc.pool.close()
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:>20}: {v:.2f}" if isinstance(v, float) else f"{k:>20}: {v}")


if __name__ == "__main__":
    main()
