"""The RadixKV gRPC servicer: proto <-> KVService, and the one error table.

Each project exception names its status code (`RadixKVError.code`); the servicer aborts with that
code, the message (which carries the numbers), and the exception's class name in the trailing
metadata key `radixkv-error`, so the client can raise the same class again.
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

from gpu_pool.layout import KVLayout
from radixkv.errors import ALL_ERRORS, InvalidArgument, RadixKVError
from radixkv.events import KVEvent
from radixkv.service import KVService
from radixkv.tokens import ids_from_bytes, ids_to_bytes
from radixkv.v1 import radixkv_pb2 as pb
from radixkv.v1 import radixkv_pb2_grpc

log = logging.getLogger("radixkv.server.app")

SERVICE_NAME = "radixkv.v1.RadixKV"
ERROR_KEY = "radixkv-error"
_CLASSES: tuple[type[RadixKVError], ...] = (RadixKVError, *ALL_ERRORS)
STATUS: dict[type[RadixKVError], grpc.StatusCode] = {
    cls: getattr(grpc.StatusCode, cls.code) for cls in _CLASSES
}

F = TypeVar("F", bound=Callable[..., Any])


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


def layout_pb(layout: KVLayout) -> pb.KVLayout:
    return pb.KVLayout(num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                       head_dim=layout.head_dim, dtype=layout.dtype,
                       block_size=layout.block_size, bytes_per_block=layout.bytes_per_block)


def event_pb(ev: KVEvent) -> pb.Event:
    out = pb.Event(sequence=ev.sequence, namespace=ev.namespace, timestamp=ev.timestamp)
    if ev.kind == "stored":
        out.stored.CopyFrom(pb.BlockStored(
            block_ids=ev.block_ids, tokens=ev.tokens, block_hashes=ev.block_hashes,
            parent_block_id=ev.parent_block_id, parent_block_hash=ev.parent_block_hash))
    elif ev.kind == "removed":
        out.removed.CopyFrom(pb.BlockRemoved(block_ids=ev.block_ids,
                                             block_hashes=ev.block_hashes))
    else:
        out.cleared.CopyFrom(pb.AllBlocksCleared())
    return out


def _owner(client_id: str) -> str:
    if not client_id:
        raise InvalidArgument("client_id is required (it owns the leases this call opens)")
    return client_id


class Servicer(radixkv_pb2_grpc.RadixKVServicer):
    def __init__(self, service: KVService, max_tokens: int,
                 observer: RpcObserver | None = None) -> None:
        self.service = service
        self.max_tokens = max_tokens
        self.observer = observer
        self._closing = threading.Event()

    def close(self) -> None:
        """End open Events streams (at shutdown), so they do not hold up the grace period."""
        self._closing.set()
        self.service.events.wake_all()

    @rpc
    def PoolInfo(self, request: pb.PoolInfoRequest, context: Any) -> pb.PoolInfoResponse:
        h = self.service.pool_handle()
        return pb.PoolInfoResponse(
            layout=layout_pb(h.layout), backend=h.backend, num_blocks=h.num_blocks,
            epoch=h.epoch, shm_name=h.name, nbytes=h.nbytes, ipc_handle=h.ipc_handle,
            device_id=h.device_id, device_uuid=h.device_uuid, strides=h.strides,
            max_tokens=self.max_tokens)

    @rpc
    def Match(self, request: pb.MatchRequest, context: Any) -> pb.MatchResponse:
        if not request.queries:
            raise InvalidArgument("Match needs at least one query")
        outcomes = self.service.match_many(
            _owner(request.client_id), [(q.namespace, q.tokens) for q in request.queries])
        response = pb.MatchResponse(epoch=self.service.pool.epoch)
        add = response.results.add  # ~1.5 us less per result than building a list (upb)
        for o in outcomes:
            add(lease_id=o.lease_id, num_tokens=o.num_tokens, block_ids=ids_to_bytes(o.block_ids))
        return response

    @rpc
    def Allocate(self, request: pb.AllocateRequest, context: Any) -> pb.AllocateResponse:
        o = self.service.allocate(_owner(request.client_id), request.lease_id or None,
                                  request.namespace, request.num_blocks)
        return pb.AllocateResponse(epoch=self.service.pool.epoch, lease_id=o.lease_id,
                                   block_ids=ids_to_bytes(o.block_ids),
                                   num_evicted=o.num_evicted)

    @rpc
    def Insert(self, request: pb.InsertRequest, context: Any) -> pb.InsertResponse:
        if not request.items:
            raise InvalidArgument("Insert needs at least one item")
        owner = _owner(request.client_id)
        results = []
        for item in request.items:
            o = self.service.insert(owner, item.lease_id, item.namespace, item.tokens,
                                    ids_from_bytes(item.block_ids))
            results.append(pb.InsertResult(adopted=ids_to_bytes(o.adopted),
                                           duplicates=ids_to_bytes(o.duplicates),
                                           num_cached_tokens=o.num_cached_tokens))
        return pb.InsertResponse(results=results)

    @rpc
    def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.ReleaseResponse:
        if not request.lease_ids:
            raise InvalidArgument("Release needs at least one lease id")
        freed = self.service.release(_owner(request.client_id), request.lease_ids)
        return pb.ReleaseResponse(num_freed=freed)

    @rpc
    def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        s = self.service.stats()
        bs = self.service.block_size
        integrity = ""
        if request.check_integrity:
            try:
                self.service.check_integrity()
                integrity = "ok"
            except AssertionError as e:
                integrity = f"FAILED: {e}"
        # ServiceStats and NamespaceStats name their fields as the proto does
        counters = {f.name: getattr(s, f.name) for f in dataclasses.fields(s)
                    if f.name != "namespaces"}
        return pb.StatsResponse(
            **counters, integrity=integrity, backend=self.service.pool.backend,
            layout=layout_pb(self.service.pool.layout), epoch=self.service.pool.epoch,
            namespaces=[pb.NamespaceStats(**dataclasses.asdict(n),
                                          cached_tokens=n.cached_blocks * bs)
                        for n in s.namespaces])

    @rpc
    def Clear(self, request: pb.ClearRequest, context: Any) -> pb.ClearResponse:
        return pb.ClearResponse(num_freed=self.service.clear(request.namespace))

    @rpc
    def DumpTree(self, request: pb.DumpTreeRequest, context: Any) -> pb.DumpTreeResponse:
        nodes, last = self.service.dump_tree(request.namespace, request.max_depth)
        return pb.DumpTreeResponse(namespace=request.namespace, last_sequence=last, nodes=[
            pb.TreeNode(node_id=n.node_id, parent_id=n.parent_id or 0,
                        depth_tokens=n.depth_tokens, tokens=n.tokens, block_ids=n.block_ids,
                        lock_count=n.lock_count, hits=n.hits, last_access=n.last_access)
            for n in nodes])

    def Events(self, request: pb.EventsRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        """Consecutive events from `from_sequence` (0: from now on). If some were already
        dropped from the replay buffer, one event with `lagged` set (its sequence is the first
        one missed) ends the stream: rebuild from DumpTree, resume after its last_sequence.
        With a namespace filter, sequence numbers still increase but skip other namespaces."""
        log_ = self.service.events
        last = log_.last_sequence
        if request.from_sequence > last + 1:
            # Most likely a subscriber resuming across a service restart (numbers restart at
            # 1); waiting for that number would silently skip everything up to it.
            _abort(context, "Events", InvalidArgument(
                f"from_sequence {request.from_sequence} is ahead of the last event {last} "
                f"(pool epoch {self.service.pool.epoch}; did the service restart?)"))
        after = request.from_sequence - 1 if request.from_sequence else last
        while context.is_active() and not self._closing.is_set():
            events, lagged = log_.read(after, timeout=0.25)
            if lagged:
                yield pb.Event(sequence=after + 1, lagged=True)
                return
            for ev in events:
                after = ev.sequence
                if not request.namespace or ev.namespace == request.namespace:
                    yield event_pb(ev)
