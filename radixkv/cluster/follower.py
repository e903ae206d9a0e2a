"""A router's follower of one member: keeps that member's part of the ClusterIndex current.

    (re)build:  Stats -> namespaces + event_sequence S  (read together, under the service lock)
                DumpTree of each namespace, page by page (a cursor; the member holds its
                lock for one page only) -> its blocks' hashes + the sequence D_ns of the
                first page; pages read later may hold changes after D_ns, which the events
                after D_ns replay on top (radixkv/index/pages.py); a page over the member's
                message limit is asked again at half the size
                index.replace(member, blocks, and on a sliding-window member the blocks whose
                window part it holds: it resumes only where its last blocks have theirs)
    follow:     Events from S + 1 (epoch-checked); an event of namespace ns is applied only if
                its sequence > D_ns (else the snapshot has it already); a namespace created
                after the Stats read has no snapshot and takes every event after S
    lagged      (the member's replay buffer dropped events we had not read): rebuild
    new epoch   (the member restarted): the resume is refused; rebuild
    indexed     once the member answers the Events call (its stream runs, not just queued)
    unreachable (connect or stream error): state "unreachable", retry; the index keeps what
                it had (Route skips the member until it is indexed again); back: resume
                Events after the last sequence read (same epoch), and rebuild only if that is
                refused (lagged, or a new epoch)
    backoff     a retry or rebuild that follows a failed one waits BACKOFF_S, doubling up to
                MAX_BACKOFF_S, each wait drawn within +-50 % (jitter: routers do not retry in
                step); a member that stayed indexed STABLE_S resets it

The loop runs in its own thread until stop(); stop() closes the channel, which cancels the
blocked stream.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Any

from radixkv.client import Client
from radixkv.cluster.index import ClusterIndex
from radixkv.protocol.block_hashes import chain_hashes
from radixkv.protocol.errors import InvalidArgument, NotFound, RadixKVError, StalePool, Unavailable
from radixkv.protocol.limits import HOLE
from radixkv.protocol.values import NodeView
from radixkv.rpc.membership import MemberInfo

log = logging.getLogger("radixkv.cluster")

BACKOFF_S = 0.1  # the first retry's wait
MAX_BACKOFF_S = 5.0
STABLE_S = 10.0  # indexed this long: the next failure starts the backoff over
PAGE_SIZE = 1024  # DumpTree nodes per page (halved while a page passes the message limit)


def backoff_s(failures: int) -> float:
    """The wait before retry number `failures` (1, 2, ...): exponential, capped, +-50 %."""
    base: float = min(MAX_BACKOFF_S, BACKOFF_S * 2.0 ** min(failures - 1, 16))
    return base * random.uniform(0.5, 1.5)


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
        self._failures = 0  # failed tries in a row (the backoff's exponent)
        self._indexed_at: float | None = None  # when the last try reached "indexed"
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
            self._indexed_at = None
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
            stable = self._indexed_at is not None \
                and time.monotonic() - self._indexed_at >= STABLE_S
            self._failures = 1 if stable else self._failures + 1
            self._stop.wait(backoff_s(self._failures))

    def _follow(self, kv: Client) -> None:
        self.state = "syncing"
        st = kv.stats()
        epoch, after = str(st["epoch"]), int(st["event_sequence"])
        block_size = int(st["layout"]["block_size"])
        window_blocks = kv.pool_info().layout.window_blocks
        blocks: dict[str, set[int]] = {}
        windows: dict[str, set[int]] = {}
        marks: dict[str, int] = {}
        for ns in st["namespaces"]:
            name = ns["namespace"]
            try:
                blocks[name], windows[name], marks[name] = self._dump(kv, name, block_size)
            except NotFound:
                continue  # dropped since: its removal events follow
        self.index.replace(self.node_id, blocks, windows, window_blocks)
        self.epoch = epoch
        self.resyncs += 1
        self._continue(kv, epoch, after, marks)

    def _dump(self, kv: Client, namespace: str,
              block_size: int) -> tuple[set[int], set[int], int]:
        """Every block hash of `namespace`, paged, those whose window part is held, and the
        sequence of the first page. NotFound if it is gone before the first page (after it:
        what was read is kept, its removal events follow)."""
        hashes: set[int] = set()
        windows: set[int] = set()
        cursor, first, size = b"", -1, PAGE_SIZE
        while not self._stop.is_set():
            try:
                page = kv.dump_page(namespace, cursor, size)
            except NotFound:
                if first < 0:
                    raise
                break
            except RadixKVError as e:
                if "larger than max" not in str(e) or size == 1:
                    raise
                size //= 2  # a page of long edges passed the message limit
                continue
            if first < 0:
                first = page.last_sequence
            if not cursor and not page.next_cursor and page.nodes \
                    and not page.nodes[0].block_hashes and page.nodes[0].block_ids:
                # a member that does not page answers the whole tree at once, without hashes
                # (nor window events: its window parts count as held)
                held = snapshot_hashes(namespace, list(page.nodes), block_size)
                return held, held, first
            for n in page.nodes:
                hashes.update(n.block_hashes)
                windows.update(h for h, w in zip(n.block_hashes, n.window_ids, strict=False)
                               if w != HOLE)
            if not page.next_cursor:
                break
            cursor = page.next_cursor
        return hashes, windows, first

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
        self._indexed_at = time.monotonic()

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
            elif kind == "window_stored":
                index.window_stored(me, ev.namespace, ev.window_stored.block_hashes)
            elif kind == "window_removed":
                index.window_removed(me, ev.namespace, ev.window_removed.block_hashes)
            self.events_applied += 1
