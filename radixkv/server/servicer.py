"""The RadixKV gRPC servicer: proto <-> KVService.

Each project exception names its status code (`RadixKVError.code`); the servicer aborts through
radixkv.wire's table with that code, the message (which carries the numbers), and the
exception's class name in the trailing metadata key `radixkv-error`, so the client can raise the
same class again.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, Protocol, TypeVar

import grpc

from radixkv.errors import (
    IntegrityError,
    InvalidArgument,
    LimitExceeded,
    RadixKVError,
    StalePool,
)
from radixkv.events import KVEvent
from radixkv.service import KVService
from radixkv.tokens import ids_from_bytes, ids_to_bytes
from radixkv.v1 import radixkv_pb2 as pb
from radixkv.v1 import radixkv_pb2_grpc
from radixkv.wire import ERROR_KEY, STATUS, layout_pb, pool_info_pb

log = logging.getLogger("radixkv.server.app")

SERVICE_NAME = "radixkv.v1.RadixKV"

F = TypeVar("F", bound=Callable[..., Any])

MAX_BATCH = 4096  # queries per Match, items per Insert, ids per Release / KeepAlive
INTEGRITY_SHARE = 0.1  # Stats' O(pool) integrity checks may take at most this share of time


class RpcObserver(Protocol):
    """Told about every unary call the `rpc` wrapper runs (radixkv.server.metrics implements it)."""

    def observe_rpc(self, method: str, seconds: float, code: str) -> None: ...


def _abort(context: grpc.ServicerContext, method: str, e: Exception) -> NoReturn:
    """Abort through the one table: a project error keeps its status and class name; anything
    else is a bug and becomes INTERNAL. Raises (grpc's abort always does)."""
    if isinstance(e, RadixKVError):
        context.set_trailing_metadata(((ERROR_KEY, type(e).__name__),))
        context.abort(STATUS.get(type(e), grpc.StatusCode.INTERNAL), str(e))
    else:
        log.error("internal error in %s", method, exc_info=e)
        context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")
    raise AssertionError("context.abort() returned")


def status_of(e: Exception) -> str:
    """The status code name `_abort` gives `e`."""
    if isinstance(e, RadixKVError):
        return str(STATUS.get(type(e), grpc.StatusCode.INTERNAL).name)
    return "INTERNAL"


def rpc(method: F) -> F:
    """Turn project exceptions into statuses through STATUS; anything else is INTERNAL. Reports
    each call's latency and status code to the servicer's observer, if it has one."""
    name = method.__name__

    @functools.wraps(method)
    def wrapper(self: Servicer, request: Any, context: grpc.ServicerContext) -> Any:
        observer = self.observer
        start = time.perf_counter() if observer is not None else 0.0
        try:
            response = method(self, request, context)
        except Exception as e:  # a project error, or a bug: say so, keep serving
            if observer is not None:
                observer.observe_rpc(name, time.perf_counter() - start, status_of(e))
            _abort(context, name, e)
        if observer is not None:
            observer.observe_rpc(name, time.perf_counter() - start, "OK")
        return response

    return wrapper  # type: ignore[return-value]


def event_pb(ev: KVEvent, epoch: str) -> pb.Event:
    out = pb.Event(sequence=ev.sequence, namespace=ev.namespace, timestamp=ev.timestamp,
                   epoch=epoch)
    if ev.kind == "stored":
        out.stored.CopyFrom(pb.BlockStored(
            block_ids=ev.block_ids, tokens=ev.tokens, block_hashes=ev.block_hashes,
            parent_block_id=ev.parent_block_id, parent_block_hash=ev.parent_block_hash))
    elif ev.kind == "removed":
        out.removed.CopyFrom(pb.BlockRemoved(block_ids=ev.block_ids,
                                             block_hashes=ev.block_hashes))
    elif ev.kind == "window_stored":
        out.window_stored.CopyFrom(pb.WindowStored(
            block_ids=ev.block_ids, block_hashes=ev.block_hashes, window_ids=ev.window_ids))
    elif ev.kind == "window_removed":
        out.window_removed.CopyFrom(pb.WindowRemoved(
            block_ids=ev.block_ids, block_hashes=ev.block_hashes, window_ids=ev.window_ids))
    else:
        out.cleared.CopyFrom(pb.AllBlocksCleared())
    return out


def _owner(client_id: str) -> str:
    if not client_id:
        raise InvalidArgument("client_id is required (it owns the leases this call opens)")
    return client_id


def _batch(what: str, items: Any) -> Any:
    if not items:
        raise InvalidArgument(f"{what} needs at least one")
    if len(items) > MAX_BATCH:
        raise InvalidArgument(f"{what}: {len(items)} in one call, limit {MAX_BATCH}")
    return items


class Servicer(radixkv_pb2_grpc.RadixKVServicer):
    def __init__(self, service: KVService, max_tokens: int,
                 observer: RpcObserver | None = None) -> None:
        self.service = service
        self.max_tokens = max_tokens
        self.observer = observer
        self._closing = threading.Event()
        self._integrity_lock = threading.Lock()
        self._integrity_next = 0.0  # monotonic time before which Stats skips the check

    def close(self) -> None:
        """End open Events streams (at shutdown), so they do not hold up the grace period."""
        self._closing.set()
        self.service.events.wake_all()

    @rpc
    def PoolInfo(self, request: pb.PoolInfoRequest, context: Any) -> pb.PoolInfoResponse:
        config = self.service.config
        return pool_info_pb(self.service.pool_handle(), self.max_tokens, MAX_BATCH,
                            config.lease_ttl_s, config.max_lease_ttl_s)

    @rpc
    def Match(self, request: pb.MatchRequest, context: Any) -> pb.MatchResponse:
        queries = _batch("Match: queries", request.queries)
        store = [q.store_tokens for q in queries]
        outcomes = self.service.match_many(
            _owner(request.client_id), [(q.namespace, q.tokens) for q in queries],
            request.lease_ttl_s or None, store if any(store) else None)
        response = pb.MatchResponse(epoch=self.service.epoch)
        add = response.results.add  # ~1.5 us less per result than building a list (upb)
        add_result = self.service.kind.add_result  # the namespace kind writes its own answers
        for o in outcomes:
            add_result(add, o)
        return response

    @rpc
    def Allocate(self, request: pb.AllocateRequest, context: Any) -> pb.AllocateResponse:
        o = self.service.allocate(_owner(request.client_id), request.lease_id or None,
                                  request.namespace, request.num_blocks,
                                  request.lease_ttl_s or None, request.starts_sequence,
                                  request.num_window_blocks)
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
        outcomes, freed = self.service.insert_many(_owner(request.client_id), [
            (item.lease_id, item.namespace, item.tokens, ids_from_bytes(item.block_ids))
            for item in items], [item.lease_id for item in items if item.release],
            [item.hint for item in items],
            [ids_from_bytes(item.window_ids) for item in items]
            if any(item.window_ids for item in items) else None)
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
            disk=pb.DiskStats(**dataclasses.asdict(s.disk)),
            namespaces=[pb.NamespaceStats(**dataclasses.asdict(n),
                                          cached_tokens=n.cached_blocks * bs)
                        for n in s.namespaces])

    def _integrity(self) -> str:
        """"ok" or "FAILED: <the invariant>". The check is O(pool), so it may use at most
        INTEGRITY_SHARE of the time: one asked for sooner waits (up to 50 ms) or gets
        LimitExceeded with the wait."""
        with self._integrity_lock:
            now = time.monotonic()
            if 0 < self._integrity_next - now <= 0.05:
                time.sleep(self._integrity_next - now)
                now = time.monotonic()
            if now < self._integrity_next:
                raise LimitExceeded(f"integrity checks are limited to {INTEGRITY_SHARE:.0%} of "
                                    f"the server's time; retry in "
                                    f"{self._integrity_next - now:.3f} s")
            try:
                self.service.check_integrity()
                result = "ok"
            except IntegrityError as e:
                result = f"FAILED: {e}"
            spent = time.monotonic() - now
            self._integrity_next = now + spent / INTEGRITY_SHARE
            return result

    @rpc
    def Clear(self, request: pb.ClearRequest, context: Any) -> pb.ClearResponse:
        return pb.ClearResponse(num_freed=self.service.clear(request.namespace))

    @rpc
    def DumpTree(self, request: pb.DumpTreeRequest, context: Any) -> pb.DumpTreeResponse:
        nodes, last = self.service.dump_tree(request.namespace, request.max_depth)
        return pb.DumpTreeResponse(namespace=request.namespace, last_sequence=last, nodes=[
            pb.TreeNode(node_id=n.node_id, parent_id=n.parent_id or 0,
                        depth_tokens=n.depth_tokens, tokens=n.tokens, block_ids=n.block_ids,
                        lock_count=n.lock_count, hits=n.hits, last_access=n.last_access,
                        window_ids=n.window_ids)
            for n in nodes])

    def Events(self, request: pb.EventsRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        """Consecutive events from `from_sequence` (0: from now on). If some were already
        dropped from the replay buffer, one event with `lagged` set (its sequence is the first
        one missed) ends the stream: rebuild from DumpTree, resume after its last_sequence.
        With a namespace filter, sequence numbers still increase but skip other namespaces."""
        log_ = self.service.events
        last = log_.last_sequence
        epoch = self.service.epoch
        if request.epoch and request.epoch != epoch:
            _abort(context, "Events", StalePool(
                f"events of epoch {request.epoch} are gone: the service restarted (epoch "
                f"{epoch}); rebuild from DumpTree and subscribe from its last_sequence"))
        if request.from_sequence > last + 1:
            # Most likely a subscriber resuming across a service restart (numbers restart at
            # 1); waiting for that number would silently skip everything up to it.
            _abort(context, "Events", InvalidArgument(
                f"from_sequence {request.from_sequence} is ahead of the last event {last} "
                f"(pool epoch {self.service.epoch}; did the service restart?)"))
        after = request.from_sequence - 1 if request.from_sequence else last
        while context.is_active() and not self._closing.is_set():
            events, lagged = log_.read(after, timeout=0.25)
            if lagged:
                yield pb.Event(sequence=after + 1, lagged=True, epoch=epoch)
                return
            for ev in events:
                after = ev.sequence
                if not request.namespace or ev.namespace == request.namespace:
                    yield event_pb(ev, epoch)
