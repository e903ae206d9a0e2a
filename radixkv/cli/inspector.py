"""`radixkv inspect | stats | events`: read-only views of a running service, made only from
`radixkv.client.Client` calls (Stats, DumpTree, Events).

Each view is built as plain data first (what `--json` prints, with exact counts), then rendered
with rich for people:

    summary(kv)                    pool, blocks by state, hit rates, evictions, leases, namespaces
    tree_view(kv, ns, depth)       one namespace's radix tree, largest subtrees first
    top_view(kv, ns, by, n)        the hottest prefixes
    event_dict(ev) / event_line()  one KV event as a JSON object / a human line

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
import os
import sys
import time
from typing import IO, Any

from radixkv.client import Client
from radixkv.protocol.limits import HOLE
from radixkv.protocol.tokens import from_token_bytes, num_tokens
from radixkv.protocol.values import NodeView
from radixkv.v1 import radixkv_pb2 as pb

PREVIEW = 8  # token ids shown per edge / prefix
BLOCK_STATES = ("free", "leased", "cached", "pinned")


def _rate(hit: int, query: int) -> float | None:
    return round(hit / query, 6) if query else None


def _token_ids(data: bytes, limit: int | None = None) -> list[int]:
    end = num_tokens(data) if limit is None else min(num_tokens(data), limit)
    return [int(t) for t in from_token_bytes(data)[:end]]


def _keys_hex(keys: bytes, count: int, limit: int) -> list[str]:
    """The first `limit` of `count` block keys, in hex."""
    size = len(keys) // count if count else 0
    return [keys[i * size:(i + 1) * size].hex() for i in range(min(count, limit))]


# ---- summary -------------------------------------------------------------------------------

def summary(kv: Client) -> dict[str, Any]:
    """Stats reshaped for people and scripts. `blocks.cached` includes `blocks.pinned` (as in
    the Stats RPC); free + leased + cached == total."""
    s = kv.stats()
    layout = {k: s["layout"][k] for k in ("num_layers", "num_kv_heads", "head_dim", "dtype",
                                          "block_size", "bytes_per_block")}
    blocks = {"total": s["num_blocks"], "free": s["free_blocks"], "leased": s["leased_blocks"],
              "cached": s["cached_blocks"], "pinned": s["pinned_blocks"]}
    window = {}
    if s.get("window_blocks"):  # sliding-window pool: block ids are full or window parts
        window = {"window_parts": {"total": s["window_blocks"], "free": s["free_window_blocks"],
                                   "cached": s["cached_window_blocks"]}}
    disk = s.get("disk") or {}
    if disk.get("capacity_blocks"):  # the tiers: where the hits, blocks and bytes are
        window["tiers"] = {
            "memory": {"hit_tokens": s["hit_tokens"] - disk["hit_tokens"],
                       "blocks": s["cached_blocks"],
                       "bytes": s["cached_blocks"] * layout["bytes_per_block"]},
            "disk": {"hit_tokens": disk["hit_tokens"], "blocks": disk["blocks"],
                     "bytes": disk["bytes"], **{k: disk[k] for k in (
                         "capacity_blocks", "demoted_blocks", "promoted_blocks",
                         "evicted_blocks", "verify_failures", "loaded_blocks",
                         "dropped_at_load", "generation", "pending_writes", "write_errors")},
                     "state": disk.get("state", ""), "last_error": disk.get("last_error", "")}}
    return {
        "target": kv.target, "epoch": s["epoch"], "uptime_s": round(s["uptime_s"], 3),
        "pool": {"backend": s["backend"], "layout": layout, "blocks": blocks,
                 "bytes": {k: v * layout["bytes_per_block"] for k, v in blocks.items()}},
        "hit_rate": {
            "lifetime": {"requests": s["requests"], "query_tokens": s["query_tokens"],
                         "hit_tokens": s["hit_tokens"],
                         "rate": _rate(s["hit_tokens"], s["query_tokens"])},
            "recent": {"requests": s["recent_requests"],
                       "query_tokens": s["recent_query_tokens"],
                       "hit_tokens": s["recent_hit_tokens"],
                       "rate": _rate(s["recent_hit_tokens"], s["recent_query_tokens"])},
        },
        **window,
        "evicted_blocks": s["evicted_blocks"],
        "leases": {"live": s["live_leases"], "expired": s["expired_leases"]},
        "namespaces": [{**{k: n[k] for k in ("namespace", "cached_blocks", "cached_tokens",
                                             "nodes", "requests", "query_tokens", "hit_tokens",
                                             "evicted_blocks")},
                        "hit_rate": _rate(n["hit_tokens"], n["query_tokens"])}
                       for n in s["namespaces"]],
    }


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _pct(rate: float | None) -> str:
    return "-" if rate is None else f"{100 * rate:.1f}%"


def _age(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def plain(text: str) -> str:
    """Server-supplied text made safe for a terminal: control and other unprintable characters
    shown as escapes (a name can never move the cursor or recolour the screen)."""
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def markup_safe(text: str) -> str:
    """`plain`, with rich markup escaped too (for text rich renders: tables, trees)."""
    from rich.markup import escape

    return escape(plain(text))


def render_summary(d: dict[str, Any]) -> Any:
    from rich import box
    from rich.console import Group
    from rich.table import Table

    pool, lay, blocks = d["pool"], d["pool"]["layout"], d["pool"]["blocks"]
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("service", f"{markup_safe(d['target'])}, up {_age(d['uptime_s'])}")
    head.add_row("epoch", markup_safe(d["epoch"]))
    head.add_row("pool", f"{pool['backend']}, {blocks['total']} blocks x "
                 f"{_size(lay['bytes_per_block'])} ({lay['block_size']} tokens) = "
                 f"{_size(pool['bytes']['total'])}")
    head.add_row("layout", f"{lay['num_layers']} layers x {lay['num_kv_heads']} kv heads x "
                 f"{lay['head_dim']}, {lay['dtype']}")
    head.add_row("blocks", f"{blocks['free']} free, {blocks['leased']} leased, "
                 f"{blocks['cached']} cached ({blocks['pinned']} of them pinned)")
    if "window_parts" in d:
        w = d["window_parts"]
        head.add_row("window parts", f"{w['free']} free, {w['cached']} cached of {w['total']} "
                     "(the windowed layers' KV; blocks above are the full parts)")
    head.add_row("bytes", f"{_size(pool['bytes']['free'])} free, "
                 f"{_size(pool['bytes']['cached'])} cached")
    for span, h in d["hit_rate"].items():
        what = "lifetime" if span == "lifetime" else f"last {h['requests']}"
        head.add_row(f"hit rate ({what})", f"{_pct(h['rate'])}: {h['hit_tokens']} of "
                     f"{h['query_tokens']} tokens, {h['requests']} requests")
    if "tiers" in d:
        mem, disk = d["tiers"]["memory"], d["tiers"]["disk"]
        writes = f"; writes {disk['state']}" if disk["state"] else ""
        if disk["state"] == "failing":
            writes = f"; writes FAILING (retried): {disk['last_error']}"
        elif disk["write_errors"]:
            writes += f" ({disk['write_errors']} errors, the last: {disk['last_error']})"
        head.add_row("disk tier", f"{disk['blocks']} of {disk['capacity_blocks']} blocks "
                     f"({_size(disk['bytes'])}); hits: {mem['hit_tokens']} tokens in memory, "
                     f"{disk['hit_tokens']} from disk; {disk['demoted_blocks']} demoted, "
                     f"{disk['promoted_blocks']} promoted, {disk['evicted_blocks']} dropped, "
                     f"{disk['verify_failures']} failed their checksum{writes}")
    head.add_row("evictions", f"{d['evicted_blocks']} blocks")
    head.add_row("leases", f"{d['leases']['live']} live, {d['leases']['expired']} expired")
    spaces = Table(box=box.SIMPLE_HEAD)
    for col in ("namespace", "blocks", "tokens", "nodes", "requests", "hit rate", "evicted"):
        spaces.add_column(col, justify="left" if col == "namespace" else "right")
    for n in d["namespaces"]:
        spaces.add_row(markup_safe(n["namespace"]), str(n["cached_blocks"]),
                       str(n["cached_tokens"]), str(n["nodes"]), str(n["requests"]),
                       _pct(n["hit_rate"]), str(n["evicted_blocks"]))
    return Group(head, spaces) if d["namespaces"] else head


# ---- tree and top --------------------------------------------------------------------------

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
            "first_token_ids": _token_ids(n.tokens, PREVIEW), "block_ids": list(n.block_ids),
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


def _ids(ids: list[int], total: int) -> str:
    return " ".join(map(str, ids)) + (" ..." if total > len(ids) else "")


def render_tree(t: dict[str, Any]) -> Any:
    from rich.tree import Tree

    root = Tree(f"[bold]{markup_safe(t['namespace'])}[/]: {t['nodes']} nodes, "
                f"{t['cached_blocks']} blocks, {t['cached_tokens']} tokens "
                f"(as of event {t['last_sequence']})")

    def add(parent: Tree, n: dict[str, Any]) -> None:
        if "first_keys" in n:  # key-keyed: keys (hex, cut short), no tokens
            keys = " ".join(k[:16] for k in n["first_keys"])
            label = (f"[cyan]\\[{keys}{' ...' if n['blocks'] > len(n['first_keys']) else ''}]"
                     f"[/] {n['blocks']} keys  hits {n['hits']}  locks {n['lock_count']}  "
                     f"{_age(n['age_s'])} ago")
        else:
            label = (f"[cyan]\\[{_ids(n['first_token_ids'], n['tokens'])}][/] {n['tokens']} "
                     f"tok {n['blocks']} blk (subtree {n['subtree_tokens']} tok)  hits "
                     f"{n['hits']}  locks {n['lock_count']}  {_age(n['age_s'])} ago")
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
        head[node.node_id] = up + (_token_ids(node.tokens, need) if need > 0 else [])
        blocks[node.node_id] = (blocks[node.parent_id] if node.parent_id else 0) \
            + len(node.block_ids)
    rows: list[dict[str, Any]] = [
        {"node_id": v.node_id, "depth_tokens": v.depth_tokens, "depth_blocks": blocks[v.node_id],
         "hits": v.hits, "tokens_saved": v.hits * v.depth_tokens, "lock_count": v.lock_count,
         "age_s": round(max(0.0, now - v.last_access), 3), "first_token_ids": head[v.node_id],
         "edge_token_ids": _token_ids(v.tokens, PREVIEW)}
        for v in nodes if v.hits]
    key = "hits" if by == "hits" else "tokens_saved"
    rows.sort(key=lambda r: (-r[key], -r["depth_tokens"], r["node_id"]))
    return {"namespace": namespace, "last_sequence": last, "by": by, "prefixes": rows[:n]}


def render_top(t: dict[str, Any]) -> Any:
    from rich import box
    from rich.table import Table

    table = Table(title=f"{markup_safe(t['namespace'])}: top prefixes by {t['by']}",
                  title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("#", "node", "tokens", "hits", "saved", "locks", "touched"):
        table.add_column(col, justify="right")
    table.add_column("prefix", no_wrap=True, overflow="ellipsis")
    for i, r in enumerate(t["prefixes"], 1):
        table.add_row(str(i), str(r["node_id"]), str(r["depth_tokens"]), str(r["hits"]),
                      str(r["tokens_saved"]), str(r["lock_count"]), _age(r["age_s"]) + " ago",
                      _ids(r["first_token_ids"], r["depth_tokens"]))
    return table


# ---- events --------------------------------------------------------------------------------

def event_dict(ev: pb.Event) -> dict[str, Any]:
    """An event with vLLM's names (BlockStored / BlockRemoved / AllBlocksCleared), or Lagged."""
    kind = ev.WhichOneof("kind")
    if kind == "lagged":
        return {"sequence": ev.sequence, "epoch": ev.epoch, "type": "Lagged"}
    out: dict[str, Any] = {"sequence": ev.sequence, "epoch": ev.epoch,
                           "namespace": ev.namespace, "timestamp": ev.timestamp}
    if kind == "stored":
        st = ev.stored
        out.update(type="BlockStored", block_ids=list(st.block_ids),
                   parent_block_id=st.parent_block_id if st.HasField("parent_block_id")
                   else None, token_ids=_token_ids(st.tokens),
                   block_hashes=list(st.block_hashes),
                   parent_block_hash=st.parent_block_hash
                   if st.HasField("parent_block_hash") else None)
    elif kind == "removed":
        out.update(type="BlockRemoved", block_ids=list(ev.removed.block_ids),
                   block_hashes=list(ev.removed.block_hashes))
        if ev.removed.tier:  # where they went: the disk tier below the pool
            out.update(tier=ev.removed.tier)
    elif kind in ("window_stored", "window_removed"):
        w = getattr(ev, kind)
        out.update(type="WindowStored" if kind == "window_stored" else "WindowRemoved",
                   block_ids=list(w.block_ids), window_ids=list(w.window_ids),
                   block_hashes=list(w.block_hashes))
    else:
        out["type"] = "AllBlocksCleared"
    return out


def event_line(d: dict[str, Any]) -> str:
    if d["type"] == "Lagged":
        return (f"#{d['sequence']} lagged: events from here on were dropped from the replay "
                "buffer; rebuild with `radixkv inspect tree` and resume after its sequence")
    stamp = time.strftime("%H:%M:%S", time.localtime(d["timestamp"]))
    line = f"#{d['sequence']} {stamp} {plain(d['namespace'])} {d['type']}"
    if d["type"] == "BlockStored":
        parent = "root" if d["parent_block_id"] is None else f"block {d['parent_block_id']}"
        tokens = d["token_ids"]
        line += (f" blocks {d['block_ids']} after {parent}, {len(tokens)} tokens "
                 f"[{_ids(tokens[:PREVIEW], len(tokens))}]")
    elif d["type"] == "BlockRemoved":
        line += f" blocks {d['block_ids']}"
    elif d["type"] in ("WindowStored", "WindowRemoved"):
        line += f" window parts {d['window_ids']} of blocks {d['block_ids']}"
    return line


def tail_events(kv: Client, from_sequence: int, namespace: str, as_json: bool,
                count: int = 0, timeout: float | None = None,
                out: IO[str] | None = None, epoch: str = "") -> int:
    """Print events until Ctrl-C, `count` events or `timeout` s. Returns 3 after a lag.
    `epoch`: the epoch `from_sequence` belongs to (StalePool if the service restarted)."""
    out = out or sys.stdout
    seen = 0
    for ev in kv.events(from_sequence, namespace, timeout=timeout, epoch=epoch):
        d = event_dict(ev)
        print(json.dumps(d) if as_json else event_line(d), file=out, flush=True)
        if d["type"] == "Lagged":
            return 3
        seen += 1
        if count and seen >= count:
            break
    return 0


def watch(kv: Client, seconds: float, as_json: bool) -> int:
    """Reprint the summary every `seconds` until Ctrl-C (rich Live on a terminal; plain
    reprints, or JSON lines, otherwise)."""
    from rich.console import Console
    from rich.live import Live

    console = Console()
    try:
        if as_json or not console.is_terminal:
            while True:
                d = summary(kv)
                if as_json:
                    print(json.dumps(d), flush=True)
                else:
                    console.print(render_summary(d))
                time.sleep(seconds)
        with Live(render_summary(summary(kv)), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(seconds)
                live.update(render_summary(summary(kv)), refresh=True)
    except KeyboardInterrupt:
        return 0


def show(view: Any, as_json: bool, render: Any) -> None:
    if as_json:
        print(json.dumps(view, indent=2))
    else:
        from rich.console import Console

        Console().print(render(view))



def run(args: argparse.Namespace) -> int:
    """Entry point of `radixkv inspect | stats | events` (their flags live in radixkv.cli.main)."""
    target = args.target or (os.path.abspath(args.socket) if args.socket else None)
    with Client(target) as kv:
        if args.command == "events":
            return tail_events(kv, args.from_sequence, args.namespace, args.json, args.count,
                               args.timeout, epoch=args.epoch)
        if args.command == "stats" and args.watch:
            return watch(kv, args.watch, args.json)
        view = getattr(args, "view", None) or "summary"
        if view == "tree":
            show(tree_view(kv, args.namespace, args.depth), args.json, render_tree)
        elif view == "top":
            show(top_view(kv, args.namespace, args.by, args.n), args.json, render_top)
        else:
            show(summary(kv), args.json, render_summary)
    return 0
