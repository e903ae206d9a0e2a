"""A router's follower of one member: keeps that member's part of the ClusterIndex current.

    (re)build:  Stats -> namespaces + event_sequence S  (read together, under the service lock)
                DumpTree of each namespace -> its blocks + the sequence D_ns it reflects
                index.replace(member, blocks)
    follow:     Events from S + 1 (epoch-checked); an event of namespace ns is applied only if
                its sequence > D_ns (else the snapshot has it already); a namespace created
                after the Stats read has no snapshot and takes every event after S
    lagged      (the member's replay buffer dropped events we had not read): rebuild
    new epoch   (the member restarted): the resume is refused; rebuild
    indexed     once the member answers the Events call (its stream runs, not just queued)
    unreachable (connect or stream error): state "unreachable", retry every second; the
                index keeps what it had (Route skips the member until it is indexed again);
                back: resume Events after the last sequence read (same epoch), and rebuild
                only if that is refused (lagged, or a new epoch)

The loop runs in its own thread until stop(); stop() closes the channel, which cancels the
blocked stream.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from radixkv.client import Client
from radixkv.cluster.index import ClusterIndex
from radixkv.cluster.membership import MemberInfo
from radixkv.errors import InvalidArgument, NotFound, RadixKVError, StalePool, Unavailable
from radixkv.events import chain_hashes
from radixkv.types import NodeView

log = logging.getLogger("radixkv.cluster")

RETRY_S = 1.0


class _Resync(Exception):
    """The member's event stream cannot be resumed: rebuild from snapshots."""


def snapshot_hashes(namespace: str, nodes: list[NodeView], block_size: int) -> set[int]:
    """Every block hash of a DumpTree snapshot (nodes in DFS pre-order, parents first)."""
    last: dict[int, int] = {}  # node id -> the hash of its last block
    out: set[int] = set()
    for n in nodes:
        parent = last.get(n.parent_id) if n.parent_id is not None else None
        hashes = chain_hashes(namespace, n.tokens, block_size, parent)
        out.update(hashes)
        if hashes:
            last[n.node_id] = hashes[-1]
        elif parent is not None:
            last[n.node_id] = parent
    return out


class Follower:
    """Follows one member; its public fields are read by Members (racy reads are fine)."""

    def __init__(self, info: MemberInfo, index: ClusterIndex, token: str | None = None) -> None:
        self.info = info
        self.token = token
        self.index = index
        self.state = "syncing"  # "indexed" | "syncing" | "unreachable"
        self.error = ""
        self.epoch = info.epoch
        self.events_applied = 0
        self.resyncs = 0
        self.routed = 0
        self.live_leases = 0
        self.counters: dict[str, int] = {"requests": 0, "query_tokens": 0, "hit_tokens": 0}
        self.joined = time.monotonic()
        self._resume: tuple[str, int, dict[str, int]] | None = None  # epoch, last read, marks
        self._stop = threading.Event()
        self._kv: Client | None = None
        self._thread = threading.Thread(target=self._run, name=f"follow-{info.node_id}",
                                        daemon=True)

    @property
    def node_id(self) -> str:
        return self.info.node_id

    @property
    def healthy(self) -> bool:
        return self.state == "indexed"

    def start(self) -> None:
        self._thread.start()

    def stop(self, join: bool = True) -> None:
        self._stop.set()
        kv = self._kv
        if kv is not None:
            kv.close()  # cancels a blocked Events stream
        if join and self._thread.is_alive():
            self._thread.join(5)

    def poll(self) -> None:
        """Refresh the load figures from the member's Stats (the router's poller calls it)."""
        kv = self._kv
        if kv is None or not self.healthy:
            return
        try:
            st = kv.stats()
        except (RadixKVError, ValueError):
            return  # the follower's own loop notices a dead member
        self.live_leases = int(st["live_leases"])
        self.counters = {k: int(st[k]) for k in self.counters}

    def _run(self) -> None:
        while not self._stop.is_set():
            kv = None
            try:
                kv = self._kv = Client(self.info.address, client_id=f"router-{id(self):x}",
                                       timeout=5.0, token=self.token)
                if self._resume is not None:
                    self._continue(kv, *self._resume)
                else:
                    self._follow(kv)
            except (_Resync, StalePool, InvalidArgument) as e:  # resume refused: rebuild
                self._resume = None
                self.state, self.error = "syncing", str(e)
                log.info("member %s: %s; rebuilding from DumpTree", self.node_id, e)
                continue
            except (RadixKVError, ValueError) as e:
                if self._stop.is_set():
                    break
                if self.state != "unreachable":
                    log.warning("member %s at %s unreachable: %s", self.node_id,
                                self.info.address, e)
                self.state, self.error = "unreachable", str(e)
            finally:
                if kv is not None:
                    kv.close()
            self._stop.wait(RETRY_S)

    def _follow(self, kv: Client) -> None:
        self.state = "syncing"
        st = kv.stats()
        epoch, after = str(st["epoch"]), int(st["event_sequence"])
        block_size = int(st["layout"]["block_size"])
        blocks: dict[str, set[int]] = {}
        marks: dict[str, int] = {}
        for ns in st["namespaces"]:
            name = ns["namespace"]
            try:
                nodes, marks[name] = kv.dump_tree(name)
            except NotFound:
                continue  # dropped since: its removal events follow
            blocks[name] = snapshot_hashes(name, nodes, block_size)
        self.index.replace(self.node_id, blocks)
        self.epoch = epoch
        self.resyncs += 1
        self._continue(kv, epoch, after, marks)

    def _continue(self, kv: Client, epoch: str, after: int, marks: dict[str, int]) -> None:
        """Follow Events after sequence `after` of `epoch` (StalePool if the member has
        restarted since, a lagged event if its buffer no longer reaches back)."""
        self._resume = (epoch, after, marks)
        now = kv.pool_info().epoch  # reachable, and still the same service start?
        if now != epoch:
            raise StalePool(f"the member restarted (epoch {epoch} -> {now})")
        events = kv.events(from_sequence=after + 1, epoch=epoch, opened=self._opened)
        self._apply(events, marks, after, epoch)
        if not self._stop.is_set():
            raise Unavailable("the member ended its event stream (stopping?)")

    def _opened(self) -> None:
        """The member runs our Events stream (its first response came): route to it."""
        self.state, self.error = "indexed", ""

    def _apply(self, events: Any, marks: dict[str, int], after: int, epoch: str) -> None:
        index, me = self.index, self.node_id
        for ev in events:
            if self._stop.is_set():
                return
            kind = ev.WhichOneof("kind")
            if kind == "lagged":
                raise _Resync(f"missed events from {ev.sequence} (the member's event buffer "
                              "moved past them)")
            self._resume = (epoch, ev.sequence, marks)
            if ev.sequence <= marks.get(ev.namespace, after):
                continue
            if kind == "stored":
                index.stored(me, ev.namespace, ev.stored.block_hashes)
            elif kind == "removed":
                index.removed(me, ev.namespace, ev.removed.block_hashes)
            elif kind == "cleared":
                index.cleared(me, ev.namespace)
            self.events_applied += 1
