"""`radixkv events`: tail the KV event stream of a running service (the Events RPC), each event
as a JSON object with vLLM's names (`event_dict`) or a human line (`event_line`). Exits 3 after
`lagged` (the service dropped events this subscriber had not read)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import IO, Any

from radixkv.cli.flags import connection_parent, service_target
from radixkv.cli.render import PREVIEW, ids, plain, token_ids
from radixkv.client import Client
from radixkv.v1 import radixkv_pb2 as pb


def register(sub: Any) -> None:
    """Add `radixkv events`."""
    p = sub.add_parser("events", parents=[connection_parent(False)],
                       help="tail the KV event stream")
    p.add_argument("--from", dest="from_sequence", type=int, default=0, metavar="SEQ",
                   help="replay from this sequence number if still buffered (default: new only)")
    p.add_argument("--epoch", default="",
                   help="the service epoch SEQ belongs to (each event shows it): refuse to "
                   "resume if the service has restarted since")
    p.add_argument("--namespace", default="", help="only this namespace's events")
    p.add_argument("--count", type=int, default=0, help="exit after this many events")
    p.add_argument("--timeout", type=float, default=None, help="exit after this many seconds")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Tail the events the flags select; 3 after a lag."""
    with Client(service_target(args)) as kv:
        return tail_events(kv, args.from_sequence, args.namespace, args.json, args.count,
                           args.timeout, epoch=args.epoch)


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
                   else None, token_ids=token_ids(st.tokens),
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
    """One `event_dict` as a line for people."""
    if d["type"] == "Lagged":
        return (f"#{d['sequence']} lagged: events from here on were dropped from the replay "
                "buffer; rebuild with `radixkv inspect tree` and resume after its sequence")
    stamp = time.strftime("%H:%M:%S", time.localtime(d["timestamp"]))
    line = f"#{d['sequence']} {stamp} {plain(d['namespace'])} {d['type']}"
    if d["type"] == "BlockStored":
        parent = "root" if d["parent_block_id"] is None else f"block {d['parent_block_id']}"
        tokens = d["token_ids"]
        line += (f" blocks {d['block_ids']} after {parent}, {len(tokens)} tokens "
                 f"[{ids(tokens[:PREVIEW], len(tokens))}]")
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
