"""`radixkv inspect`: read-only views of a running service, made only from `radixkv.client.client`
calls (Stats, DumpTree): the summary (default, radixkv/cli/summary.py), one namespace's radix
tree, its hottest prefixes; with --router, a cluster's members as its router sees them.

Each view is built as plain data first (what `--json` prints, with exact counts), then rendered
with rich for people:

    tree_view(kv, ns, depth)       one namespace's radix tree, largest subtrees first
    top_view(kv, ns, by, n)        the hottest prefixes

Definitions (from what the tree records per node):

- hits: Match queries whose cached prefix covered this node's whole prefix (a match pins the
  whole path, so every ancestor counts it too; pins taken by Insert are not hits).
- tokens saved: hits x depth_tokens, the prefill tokens those matches took from the cache for
  this prefix. A prefix's figure includes its descendants' matches, so the column ranks
  prefixes but does not add up across rows. Prefixes never hit are not listed by `top`.
- tree sizes: `subtree_tokens` / `subtree_blocks` count a node's own edge and everything below
  it, over the whole tree even when `--depth` hides the lower levels (the tree is fetched whole
  for that; `hidden_nodes` says how many nodes were cut).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from radixkv.cli.flags import connection_parent, service_target
from radixkv.cli.render import PREVIEW, age, ids, markup_safe, show, token_ids
from radixkv.cli.summary import render_summary, summary
from radixkv.client import Client
from radixkv.protocol.limits import HOLE
from radixkv.protocol.tokens import num_tokens
from radixkv.protocol.values import NodeView


def register(sub: Any) -> None:
    """Add `radixkv inspect` and its views."""
    view_conn = [connection_parent(True)]
    p = sub.add_parser("inspect", parents=[connection_parent(False)],
                       help="look into a running cache",
                       description="Views of a running service: the summary (default), one "
                       "namespace's radix tree, or its hottest prefixes; with --router, a "
                       "cluster's members as its router sees them.")
    p.add_argument("--router", metavar="PATH|TARGET",
                   help="show a router's members: health, epochs, index size, hit rates")
    views = p.add_subparsers(dest="view", metavar="VIEW")
    views.add_parser("summary", parents=view_conn, help="pool, hit rates, namespaces")
    v = views.add_parser("tree", parents=view_conn, help="one namespace's radix tree")
    v.add_argument("namespace")
    v.add_argument("--depth", type=int, default=0, help="edges to show (0: all)")
    v = views.add_parser("top", parents=view_conn, help="hottest prefixes of a namespace",
                         description="Prefixes ranked by hits (matches that reused them) or "
                         "tokens saved (hits x prefix tokens).")
    v.add_argument("namespace")
    v.add_argument("--by", choices=["hits", "tokens-saved"], default="hits")
    v.add_argument("-n", type=int, default=10, help="how many (10)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Show the view the flags name (the summary by default), or a router's members."""
    if args.router:
        return inspect_router(args.router, bool(args.json))
    with Client(service_target(args)) as kv:
        view = args.view or "summary"
        if view == "tree":
            show(tree_view(kv, args.namespace, args.depth), args.json, render_tree)
        elif view == "top":
            show(top_view(kv, args.namespace, args.by, args.n), args.json, render_top)
        else:
            show(summary(kv), args.json, render_summary)
    return 0


def _keys_hex(keys: bytes, count: int, limit: int) -> list[str]:
    """The first `limit` of `count` block keys, in hex."""
    size = len(keys) // count if count else 0
    return [keys[i * size:(i + 1) * size].hex() for i in range(min(count, limit))]


def _children(nodes: list[NodeView]) -> dict[int | None, list[NodeView]]:
    kids: dict[int | None, list[NodeView]] = {}
    for n in nodes:
        kids.setdefault(n.parent_id, []).append(n)
    return kids


def tree_view(kv: Client, namespace: str, depth: int = 0) -> dict[str, Any]:
    """The namespace's tree as nested dicts, `depth` edges deep (0: all), children largest
    subtree first (then by node id)."""
    nodes, last = kv.dump_tree(namespace)
    kids, now = _children(nodes), time.time()
    size: dict[int, tuple[int, int, int]] = {}  # node -> (tokens, blocks, nodes) below + own
    for n in reversed(nodes):  # DFS pre-order reversed: children before parents
        below = [size[c.node_id] for c in kids.get(n.node_id, [])]
        size[n.node_id] = (num_tokens(n.tokens) + sum(b[0] for b in below),
                           len(n.block_ids) + sum(b[1] for b in below),
                           1 + sum(b[2] for b in below))

    def order(parent: int | None) -> list[NodeView]:
        return sorted(kids.get(parent, []), key=lambda c: (-size[c.node_id][0], c.node_id))

    def build(n: NodeView, level: int) -> dict[str, Any]:
        tokens, blocks, count = size[n.node_id]
        out: dict[str, Any] = {
            "node_id": n.node_id, "tokens": num_tokens(n.tokens), "blocks": len(n.block_ids),
            "depth_tokens": n.depth_tokens, "lock_count": n.lock_count, "hits": n.hits,
            "age_s": round(max(0.0, now - n.last_access), 3),
            "first_token_ids": token_ids(n.tokens, PREVIEW), "block_ids": list(n.block_ids),
            "subtree_tokens": tokens, "subtree_blocks": blocks}
        if n.keys:  # a key-keyed namespace: its first block keys, in hex (no tokens)
            out["first_keys"] = _keys_hex(n.keys, len(n.block_ids), PREVIEW)
        if n.window_ids:  # sliding-window pool: each block's window part (None: freed)
            out["window_ids"] = [None if w == HOLE else w for w in n.window_ids]
        if depth and level >= depth:
            out["children"], out["hidden_nodes"] = [], count - 1
        else:
            out["children"] = [build(c, level + 1) for c in order(n.node_id)]
            out["hidden_nodes"] = 0
        return out

    roots = order(None)
    return {"namespace": namespace, "last_sequence": last, "depth": depth,
            "nodes": len(nodes), "cached_blocks": sum(size[r.node_id][1] for r in roots),
            "cached_tokens": sum(size[r.node_id][0] for r in roots),
            "children": [build(r, 1) for r in roots]}


def render_tree(t: dict[str, Any]) -> Any:
    """`tree_view` as a rich tree, one line per node."""
    from rich.tree import Tree

    root = Tree(f"[bold]{markup_safe(t['namespace'])}[/]: {t['nodes']} nodes, "
                f"{t['cached_blocks']} blocks, {t['cached_tokens']} tokens "
                f"(as of event {t['last_sequence']})")

    def add(parent: Tree, n: dict[str, Any]) -> None:
        if "first_keys" in n:  # key-keyed: keys (hex, cut short), no tokens
            keys = " ".join(k[:16] for k in n["first_keys"])
            label = (f"[cyan]\\[{keys}{' ...' if n['blocks'] > len(n['first_keys']) else ''}]"
                     f"[/] {n['blocks']} keys  hits {n['hits']}  locks {n['lock_count']}  "
                     f"{age(n['age_s'])} ago")
        else:
            label = (f"[cyan]\\[{ids(n['first_token_ids'], n['tokens'])}][/] {n['tokens']} "
                     f"tok {n['blocks']} blk (subtree {n['subtree_tokens']} tok)  hits "
                     f"{n['hits']}  locks {n['lock_count']}  {age(n['age_s'])} ago")
        if "window_ids" in n:
            marks = "".join("w" if w is not None else "." for w in n["window_ids"])
            label += f"  window parts [{marks}]"

        branch = parent.add(label)
        for c in n["children"]:
            add(branch, c)
        if n["hidden_nodes"]:
            branch.add(f"[dim]... {n['hidden_nodes']} more nodes below[/]")

    for n in t["children"]:
        add(root, n)
    return root


def top_view(kv: Client, namespace: str, by: str = "hits", n: int = 10) -> dict[str, Any]:
    """The `n` prefixes (root to the end of a node) with the most hits or tokens saved; ties go
    to the longer prefix, then the lower node id."""
    if by not in ("hits", "tokens-saved"):
        raise ValueError(f"by must be 'hits' or 'tokens-saved', got {by!r}")
    nodes, last = kv.dump_tree(namespace)
    now = time.time()
    head: dict[int, list[int]] = {}  # node -> first PREVIEW token ids of its whole prefix
    blocks: dict[int, int] = {}
    for node in nodes:  # pre-order: a parent comes before its children
        up = head.get(node.parent_id, []) if node.parent_id else []
        need = PREVIEW - len(up)
        head[node.node_id] = up + (token_ids(node.tokens, need) if need > 0 else [])
        blocks[node.node_id] = (blocks[node.parent_id] if node.parent_id else 0) \
            + len(node.block_ids)
    rows: list[dict[str, Any]] = [
        {"node_id": v.node_id, "depth_tokens": v.depth_tokens, "depth_blocks": blocks[v.node_id],
         "hits": v.hits, "tokens_saved": v.hits * v.depth_tokens, "lock_count": v.lock_count,
         "age_s": round(max(0.0, now - v.last_access), 3), "first_token_ids": head[v.node_id],
         "edge_token_ids": token_ids(v.tokens, PREVIEW)}
        for v in nodes if v.hits]
    key = "hits" if by == "hits" else "tokens_saved"
    rows.sort(key=lambda r: (-r[key], -r["depth_tokens"], r["node_id"]))
    return {"namespace": namespace, "last_sequence": last, "by": by, "prefixes": rows[:n]}


def render_top(t: dict[str, Any]) -> Any:
    """`top_view` as a rich table."""
    from rich import box
    from rich.table import Table

    table = Table(title=f"{markup_safe(t['namespace'])}: top prefixes by {t['by']}",
                  title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("#", "node", "tokens", "hits", "saved", "locks", "touched"):
        table.add_column(col, justify="right")
    table.add_column("prefix", no_wrap=True, overflow="ellipsis")
    for i, r in enumerate(t["prefixes"], 1):
        table.add_row(str(i), str(r["node_id"]), str(r["depth_tokens"]), str(r["hits"]),
                      str(r["tokens_saved"]), str(r["lock_count"]), age(r["age_s"]) + " ago",
                      ids(r["first_token_ids"], r["depth_tokens"]))
    return table


def inspect_router(target: str, as_json: bool) -> int:
    """Print a router's members: health, epochs, index size, hit rates."""
    from radixkv.cluster.routed import RouterClient

    with RouterClient(target) as rc:
        d = rc.members()
    if as_json:
        print(json.dumps(d, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"router {target}: {len(d['members'])} members in etcd {d['etcd']} "
                  f"{d['prefix']}, {d['routes']} routes, up {d['uptime_s']:.0f}s",
                  box=None, header_style="bold")
    for col in ("member", "state", "epoch", "address", "indexed blocks", "namespaces",
                "events", "resyncs", "routed", "leases", "hit rate"):
        table.add_column(col, justify="left" if col in ("member", "state", "epoch", "address")
                         else "right")
    for m in d["members"]:
        rate = f"{m['hit_tokens'] / m['query_tokens']:.1%}" if m["query_tokens"] else "-"
        state = m["state"] if not m["error"] else f"{m['state']} ({m['error'][:60]})"
        table.add_row(m["node_id"], state, m["epoch"][:12], m["address"],
                      f"{m['indexed_blocks']:,}", str(m["namespaces"]),
                      f"{m['events_applied']:,}", str(m["resyncs"]), f"{m['routed']:,}",
                      str(m["live_leases"]), rate)
    Console().print(table)
    return 0
