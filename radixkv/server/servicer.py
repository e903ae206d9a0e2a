"""The RadixKV gRPC servicer: proto <-> KVService.

Each project exception names its status code (`RadixKVError.code`); the servicer aborts through
radixkv.protocol.wire's table with that code, the message (which carries the numbers), and the
exception's class name in the trailing metadata key `radixkv-error`, so the client can raise the
same class again.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from radixkv.protocol.errors import (
    IntegrityError,
    InvalidArgument,
    LimitExceeded,
    RadixKVError,
    StalePool,
)
from radixkv.protocol.tokens import ids_from_bytes, ids_to_bytes
from radixkv.protocol.values import InsertItem, MatchQuery
from radixkv.protocol.wire import layout_pb, match_response_pb, pool_info_pb, tree_node_pb
from radixkv.rpc.handlers import RpcObserver, abort, rpc
from radixkv.server.peer_source import PeerSource
from radixkv.server.peers import PeerCounters
from radixkv.service import KVService
from radixkv.service.events import KVEvent
from radixkv.service.inspection import DUMP_PAGE
from radixkv.v1 import radixkv_pb2 as pb
from radixkv.v1 import radixkv_pb2_grpc

log = logging.getLogger("radixkv.server.app")

SERVICE_NAME = "radixkv.v1.RadixKV"

MAX_BATCH = 4096  # queries per Match, items per Insert, ids per Release / KeepAlive
INTEGRITY_SHARE = 0.1  # Stats' O(pool) integrity checks may take at most this share of time


def event_pb(ev: KVEvent, epoch: str) -> pb.Event:
    out = pb.Event(sequence=ev.sequence, namespace=ev.namespace, timestamp=ev.timestamp,
                   epoch=epoch)
    if ev.kind == "stored":
        stored = pb.BlockStored(
            block_ids=ev.block_ids, block_hashes=ev.block_hashes,
            parent_block_id=ev.parent_block_id, parent_block_hash=ev.parent_block_hash)
        if ev.key_size:  # a key-keyed namespace's blocks: their keys, no tokens
            stored.keys, stored.key_size = ev.tokens, ev.key_size
        else:
            stored.tokens = ev.tokens
        out.stored.CopyFrom(stored)
    elif ev.kind == "removed":
        out.removed.CopyFrom(pb.BlockRemoved(block_ids=ev.block_ids,
                                             block_hashes=ev.block_hashes, tier=ev.tier))
    elif ev.kind == "window_stored":
        out.window_stored.CopyFrom(pb.WindowStored(
            block_ids=ev.block_ids, block_hashes=ev.block_hashes, window_ids=ev.window_ids))
    elif ev.kind == "window_removed":
        out.window_removed.CopyFrom(pb.WindowRemoved(
            block_ids=ev.block_ids, block_hashes=ev.block_hashes, window_ids=ev.window_ids))
    else:
        out.cleared.CopyFrom(pb.AllBlocksCleared())
    return out


def _data(q: pb.MatchQuery | pb.InsertItem) -> bytes:
    """A query's or item's tokens, or its block keys (key-keyed); InvalidArgument for both
    or for keys without their size."""
    if q.key_size and q.tokens:
        raise InvalidArgument("give tokens or keys (with key_size), not both")
    if q.keys and not q.key_size:
        raise InvalidArgument("keys need key_size (the bytes of one key)")
    return q.keys if q.key_size else q.tokens


def _insert_items(items: Sequence[pb.InsertItem]) -> list[InsertItem]:
    """An Insert's items as the service takes them (InvalidArgument for bad keys or ids)."""
    keyed = any(item.key_size or item.keys for item in items)
    return [InsertItem(item.lease_id, item.namespace, _data(item) if keyed else item.tokens,
                       ids_from_bytes(item.block_ids), item.hint,
                       ids_from_bytes(item.window_ids) if item.window_ids else (), item.key_size)
            for item in items]


def _owner(client_id: str) -> str:
    if not client_id:
        raise InvalidArgument("client_id is required (it owns the leases this call opens)")
    return client_id


def _client(context: Any, client_id: str) -> str:
    """What the lease limits count a call's new leases under: its connection where the
    transport tells connections apart (TCP: the peer's address and port, which the client
    cannot choose per call), else its client id (on the Unix socket every peer is "unix:"; its
    0600 mode admits the server's own user only)."""
    peer = context.peer() if context is not None else ""
    if peer.startswith(("ipv4:", "ipv6:")):
        return f"connection {peer}"
    return f"client id {client_id!r}"


def _batch(what: str, items: Any) -> Any:
    if not items:
        raise InvalidArgument(f"{what} needs at least one")
    if len(items) > MAX_BATCH:
        raise InvalidArgument(f"{what}: {len(items)} in one call, limit {MAX_BATCH}")
    return items


class Servicer(radixkv_pb2_grpc.RadixKVServicer):
    def __init__(self, service: KVService, max_tokens: int,
                 observer: RpcObserver | None = None, source: PeerSource | None = None) -> None:
        self.service = service
        self.max_tokens = max_tokens
        self.observer = observer
        self._closing = threading.Event()
        self._integrity_lock = threading.Lock()
        self._integrity_next = 0.0  # monotonic time before which Stats refuses the check
        self._integrity_spent = 0.0  # seconds the last check took
        # peer fetch, both ways; `source`: the holder's side with its data host and TLS
        self._source = source or PeerSource(service, PeerCounters())
        self.peers = self._source.peers
        # serve --peer-fetch: radixkv/cluster/peer_fetch.py's PeerFetcher, asked before a Match
        self.peer_fetch: Any = None
        self.table: tuple[str, int] = ("", 0)  # the lookup table's segment and size, if any

    def close(self) -> None:
        """End open Events streams (at shutdown), so they do not hold up the grace period."""
        self._closing.set()
        self.service.events.wake_all()

    @rpc
    def PoolInfo(self, request: pb.PoolInfoRequest, context: Any) -> pb.PoolInfoResponse:
        config = self.service.config
        return pool_info_pb(self.service.pool_handle(), self.max_tokens, MAX_BATCH,
                            config.lease_ttl_s, config.max_lease_ttl_s, self.table,
                            self.peer_fetch is not None)

    @rpc
    def Match(self, request: pb.MatchRequest, context: Any) -> pb.MatchResponse:
        queries = _batch("Match: queries", request.queries)
        store = [q.store_tokens for q in queries]
        keyed = any(q.key_size or q.keys for q in queries)
        asked = [MatchQuery(q.namespace, _data(q), q.key_size) for q in queries]
        fetcher = self.peer_fetch
        if fetcher is not None and not request.peer_fetch_async:  # wait for peers first
            fetcher.fill(asked, context.time_remaining() if context is not None else None)
        outcomes = self.service.match_many(
            _owner(request.client_id), [(a.namespace, a.data) for a in asked],
            request.lease_ttl_s or None, store if any(store) else None,
            [q.key_size for q in queries] if keyed else None,
            client=_client(context, request.client_id))
        if fetcher is not None and request.peer_fetch_async:  # peers' blocks come meanwhile
            started = fetcher.fill_async(asked, outcomes)
            outcomes = [dataclasses.replace(o, fetching=True) if s else o
                        for o, s in zip(outcomes, started, strict=True)]
        return match_response_pb(outcomes, self.service.epoch)

    @rpc
    def Allocate(self, request: pb.AllocateRequest, context: Any) -> pb.AllocateResponse:
        o = self.service.allocate(_owner(request.client_id), request.lease_id or None,
                                  request.namespace, request.num_blocks,
                                  request.lease_ttl_s or None, request.starts_sequence,
                                  request.num_window_blocks, request.key_size,
                                  client=_client(context, request.client_id))
        return pb.AllocateResponse(epoch=self.service.epoch, lease_id=o.lease_id,
                                   block_ids=ids_to_bytes(o.block_ids),
                                   num_evicted=o.num_evicted,
                                   window_ids=ids_to_bytes(o.window_ids))

    @rpc
    def Insert(self, request: pb.InsertRequest, context: Any) -> pb.InsertResponse:
        items = _batch("Insert: items", request.items)
        epoch = self.service.epoch
        for item in items:
            if item.epoch and item.epoch != epoch:
                raise StalePool(f"blocks written under pool epoch {item.epoch}, but the service "
                                f"restarted (epoch {epoch}): their KV is not in this pool")
        outcomes, freed = self.service.insert_many(
            _owner(request.client_id), _insert_items(items),
            [item.lease_id for item in items if item.release])
        return pb.InsertResponse(results=[
            pb.InsertResult(adopted=ids_to_bytes(o.adopted), duplicates=ids_to_bytes(o.duplicates),
                            num_cached_tokens=o.num_cached_tokens,
                            num_freed=freed.pop(item.lease_id, 0) if item.release else 0)
            for o, item in zip(outcomes, items, strict=True)])

    @rpc
    def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.ReleaseResponse:
        lease_ids = _batch("Release: lease ids", request.lease_ids)
        freed = self.service.release(_owner(request.client_id), lease_ids,
                                     list(request.hints) or None)
        return pb.ReleaseResponse(num_freed=freed)

    @rpc
    def KeepAlive(self, request: pb.KeepAliveRequest, context: Any) -> pb.KeepAliveResponse:
        lease_ids = _batch("KeepAlive: lease ids", request.lease_ids)
        ttl = self.service.keep_alive(_owner(request.client_id), lease_ids,
                                      request.lease_ttl_s or None)
        return pb.KeepAliveResponse(ttl_s=ttl)

    @rpc
    def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        s = self.service.stats()
        bs = self.service.block_size
        integrity = self._integrity() if request.check_integrity else ""
        # ServiceStats and NamespaceStats name their fields as the proto does
        counters = {f.name: getattr(s, f.name) for f in dataclasses.fields(s)
                    if f.name not in ("namespaces", "layout", "disk")}
        return pb.StatsResponse(
            **counters, integrity=integrity, layout=layout_pb(s.layout),
            disk=pb.DiskStats(**dataclasses.asdict(s.disk)), peers=self.peers.stats_pb(),
            namespaces=[pb.NamespaceStats(**dataclasses.asdict(n),
                                          cached_tokens=n.cached_blocks * bs)
                        for n in s.namespaces])

    def _integrity(self) -> str:
        """"ok" or "FAILED: <the invariant>". The check is O(pool), so it may use at most
        INTEGRITY_SHARE of the time: one asked for sooner, or while another runs, gets
        LimitExceeded with the time to wait at once (a call thread never sleeps here)."""
        if not self._integrity_lock.acquire(blocking=False):
            wait = self._integrity_spent / INTEGRITY_SHARE
            raise LimitExceeded(f"an integrity check is running; retry in {wait:.3f} s", wait)
        try:
            now = time.monotonic()
            if now < self._integrity_next:
                wait = self._integrity_next - now
                raise LimitExceeded(f"integrity checks are limited to {INTEGRITY_SHARE:.0%} of "
                                    f"the server's time; retry in {wait:.3f} s", wait)
            try:
                self.service.check_integrity()
                result = "ok"
            except IntegrityError as e:
                result = f"FAILED: {e}"
            self._integrity_spent = time.monotonic() - now
            self._integrity_next = now + self._integrity_spent / INTEGRITY_SHARE
            return result
        finally:
            self._integrity_lock.release()

    @rpc
    def Clear(self, request: pb.ClearRequest, context: Any) -> pb.ClearResponse:
        return pb.ClearResponse(num_freed=self.service.clear(request.namespace))

    @rpc
    def DumpTree(self, request: pb.DumpTreeRequest, context: Any) -> pb.DumpTreeResponse:
        if request.page_size or request.cursor:
            page = self.service.dump_page(request.namespace, request.cursor,
                                          request.page_size or DUMP_PAGE, request.max_depth)
            return pb.DumpTreeResponse(namespace=request.namespace,
                                       last_sequence=page.last_sequence,
                                       next_cursor=page.next_cursor,
                                       key_size=self.service.key_size(request.namespace),
                                       nodes=[tree_node_pb(n) for n in page.nodes])
        nodes, last = self.service.dump_tree(request.namespace, request.max_depth)
        return pb.DumpTreeResponse(namespace=request.namespace, last_sequence=last,
                                   key_size=self.service.key_size(request.namespace),
                                   nodes=[tree_node_pb(n) for n in nodes])

    def FetchBlocks(self, request: pb.FetchBlocksRequest,
                    context: grpc.ServicerContext) -> Iterator[pb.FetchBlocksOffer]:
        """A peer's fetch of cached blocks (radixkv/server/peer_source.py)."""
        try:
            yield from self._source.fetch(request, _client(context, request.client_id),
                                          context.is_active)
        except RadixKVError as e:
            abort(context, "FetchBlocks", e)

    def Events(self, request: pb.EventsRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        """Consecutive events from `from_sequence` (0: from now on). If some were already
        dropped from the replay buffer, one event with `lagged` set (its sequence is the first
        one missed) ends the stream: rebuild from DumpTree, resume after its last_sequence.
        With a namespace filter, sequence numbers still increase but skip other namespaces."""
        log_ = self.service.events
        last = log_.last_sequence
        epoch = self.service.epoch
        if request.epoch and request.epoch != epoch:
            abort(context, "Events", StalePool(
                f"events of epoch {request.epoch} are gone: the service restarted (epoch "
                f"{epoch}); rebuild from DumpTree and subscribe from its last_sequence"))
        if request.from_sequence > last + 1:
            # Most likely a subscriber resuming across a service restart (numbers restart at
            # 1); waiting for that number would silently skip everything up to it.
            abort(context, "Events", InvalidArgument(
                f"from_sequence {request.from_sequence} is ahead of the last event {last} "
                f"(pool epoch {self.service.epoch}; did the service restart?)"))
        after = request.from_sequence - 1 if request.from_sequence else last
        context.send_initial_metadata(())  # the subscriber knows its stream runs
        while context.is_active() and not self._closing.is_set():
            events, lagged = log_.read(after, timeout=0.25)
            if lagged:
                yield pb.Event(sequence=after + 1, lagged=True, epoch=epoch)
                return
            for ev in events:
                after = ev.sequence
                if not request.namespace or ev.namespace == request.namespace:
                    yield event_pb(ev, epoch)
