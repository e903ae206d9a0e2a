"""The cache summary, the default view of `radixkv inspect` and `radixkv stats` (and the demo's
last stage): Stats reshaped as plain data (what `--json` prints, with exact counts), then
rendered with rich for people."""

from __future__ import annotations

from typing import Any

from radixkv.cli.render import age, markup_safe
from radixkv.client import Client

BLOCK_STATES = ("free", "leased", "cached", "pinned")


def _rate(hit: int, query: int) -> float | None:
    return round(hit / query, 6) if query else None


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
        **({"peers": [{k: v for k, v in p.items() if k != "recent_fetch_ms"}
                      for p in s["peers"]]} if s.get("peers") else {}),
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


def render_summary(d: dict[str, Any]) -> Any:
    """`summary`'s view for people: a grid of figures, then a table of the namespaces."""
    from rich import box
    from rich.console import Group
    from rich.table import Table

    pool, lay, blocks = d["pool"], d["pool"]["layout"], d["pool"]["blocks"]
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("service", f"{markup_safe(d['target'])}, up {age(d['uptime_s'])}")
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
    for p in d.get("peers", []):  # peer fetch (serve --peer-fetch), one row per member met
        g = {k: p.get(k, 0) for k in ("blocks_in", "bytes_in", "blocks_out", "bytes_out",
                                      "fetches", "failures", "checksum_failures")}
        head.add_row(f"peer {markup_safe(p['node_id'])}",
                     f"fetched {g['blocks_in']} blocks ({_size(g['bytes_in'])}) in "
                     f"{g['fetches']} fetches, sent {g['blocks_out']} blocks "
                     f"({_size(g['bytes_out'])}); {g['failures']} failed, "
                     f"{g['checksum_failures']} blocks failed their checksum")
    head.add_row("leases", f"{d['leases']['live']} live, {d['leases']['expired']} expired")
    spaces = Table(box=box.SIMPLE_HEAD)
    for col in ("namespace", "blocks", "tokens", "nodes", "requests", "hit rate", "evicted"):
        spaces.add_column(col, justify="left" if col == "namespace" else "right")
    for n in d["namespaces"]:
        spaces.add_row(markup_safe(n["namespace"]), str(n["cached_blocks"]),
                       str(n["cached_tokens"]), str(n["nodes"]), str(n["requests"]),
                       _pct(n["hit_rate"]), str(n["evicted_blocks"]))
    return Group(head, spaces) if d["namespaces"] else head
