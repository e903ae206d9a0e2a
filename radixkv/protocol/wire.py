"""The wire: the proto messages <-> the project's values, both directions, and the one status
table.

Each project exception names its gRPC status (`RadixKVError.code`); the server aborts with that
status, the message and the class name in the trailing metadata key ERROR_KEY, and a client
raises the same class again (by the status alone where one class carries it). The pool layout
and PoolInfo are written here for the server and read back here for the client, so each
quantization and window field is listed once per direction, side by side.
"""

from __future__ import annotations

import base64
import dataclasses
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any, cast

import grpc
from google.protobuf.message import Message

from kvpool import PoolHandle
from kvpool.layout import KVLayout
from radixkv.protocol.errors import ALL_ERRORS, InvalidArgument, LimitExceeded, RadixKVError
from radixkv.protocol.tokens import ids_from_bytes, ids_to_bytes
from radixkv.protocol.values import LeaseMatch, NodeView, PoolInfo, WindowLeaseMatch
from radixkv.v1 import radixkv_pb2 as pb

ERROR_KEY = "radixkv-error"  # trailing metadata: the class name of the error
RETRY_KEY = "radixkv-retry-after"  # trailing metadata: seconds to wait before a retry
AUTH_HEADER = "authorization"  # metadata: "Bearer TOKEN"
STORE_ALL = 2**32 - 1  # store_tokens meaning "every full block of the prompt"

# ---- statuses --------------------------------------------------------------------------------

ERROR_CLASSES: tuple[type[RadixKVError], ...] = (RadixKVError, *ALL_ERRORS)
STATUS: dict[type[RadixKVError], grpc.StatusCode] = {
    cls: getattr(grpc.StatusCode, cls.code) for cls in ERROR_CLASSES
}
_BY_NAME: dict[str, type[RadixKVError]] = {c.__name__: c for c in ALL_ERRORS}


def _by_code() -> dict[str, type[RadixKVError]]:
    """The status codes that one class alone carries, to that class (a status without the
    class name, e.g. from the auth interceptor or grpc itself, still maps back)."""
    carriers: dict[str, list[type[RadixKVError]]] = defaultdict(list)
    for cls in ERROR_CLASSES:
        carriers[cls.code].append(cls)
    carriers.pop(RadixKVError.code)  # INTERNAL: also any bug on the server
    carriers.pop("DATA_LOSS")  # IntegrityError: only ever sent with its name
    return {code: classes[0] for code, classes in carriers.items() if len(classes) == 1}


_BY_CODE = _by_code()


def to_error(e: grpc.RpcError) -> RadixKVError:
    """Map a status back to the project's exception (by the server's class name if sent)."""
    code = e.code().name
    message = e.details() or code
    trailing = dict(e.trailing_metadata() or ())
    cls = _BY_NAME.get(trailing.get(ERROR_KEY, "")) or _BY_CODE.get(code)
    if cls is None:  # e.g. RESOURCE_EXHAUSTED from grpc itself for an oversized message
        err = RadixKVError(f"{code}: {message}")
        err.code = code
        return err
    if cls is LimitExceeded and RETRY_KEY in trailing:
        return LimitExceeded(message, float(trailing[RETRY_KEY]))
    return cls(message)


def trailing_metadata(e: RadixKVError) -> tuple[tuple[str, str], ...]:
    """What the server sends with error `e`: its class name, and when to retry (if known)."""
    retry = getattr(e, "retry_after_s", None)
    return ((ERROR_KEY, type(e).__name__),) + (() if retry is None else
                                               ((RETRY_KEY, f"{retry:.6f}"),))


def call_credentials(token: str | None) -> list[tuple[str, str]]:
    """The metadata a client sends with every call."""
    return [(AUTH_HEADER, f"Bearer {token}")] if token else []


# ---- values ----------------------------------------------------------------------------------

# the retention hints by name: the proto enum's names in lower case ("" is none too)
_HINTS: dict[str, pb.RetentionHint] = {"": pb.RETENTION_HINT_NONE} | {
    name.removeprefix("RETENTION_HINT_").lower(): cast("pb.RetentionHint", value)
    for name, value in pb.RetentionHint.items()}


def hint_code(hint: str | int | None) -> pb.RetentionHint:
    """A retention hint's proto enum value from its name or value; InvalidArgument for others."""
    if hint is None:
        return pb.RETENTION_HINT_NONE
    if isinstance(hint, int) and hint in _HINTS.values():
        return cast("pb.RetentionHint", hint)
    if isinstance(hint, str) and hint in _HINTS:
        return _HINTS[hint]
    raise InvalidArgument(f"unknown retention hint {hint!r}; choose session_end, keep or none")


def hint_codes(hints: Sequence[str | None] | None, count: int) -> list[pb.RetentionHint]:
    """Retention hint names -> proto enum values; InvalidArgument for an unknown name or a
    count mismatch."""
    if hints is None:
        return [pb.RETENTION_HINT_NONE] * count
    if len(hints) != count:
        raise InvalidArgument(f"{len(hints)} retention hints for {count} items")
    return [hint_code(h) for h in hints]


def message_dict(msg: Message) -> dict[str, Any]:
    """A proto message as plain Python values (ints stay ints, unlike MessageToDict)."""
    out: dict[str, Any] = {}
    for field in msg.DESCRIPTOR.fields:
        value = getattr(msg, field.name)
        repeated = field.is_repeated
        if field.message_type is not None:
            out[field.name] = [message_dict(v) for v in value] if repeated else message_dict(value)
        else:
            out[field.name] = list(value) if repeated else value
    return out


def match_results(resp: pb.MatchResponse) -> list[LeaseMatch]:
    """A MatchResponse's results (WindowLeaseMatch where the answer carries window parts)."""
    epoch = resp.epoch
    return [WindowLeaseMatch(r.lease_id, r.num_tokens, ids_from_bytes(r.block_ids), epoch,
                             ids_from_bytes(r.new_block_ids), r.num_evicted, r.alloc_error,
                             window_ids=ids_from_bytes(r.window_ids),
                             new_window_ids=ids_from_bytes(r.new_window_ids))
            if r.window_ids or r.new_window_ids else
            LeaseMatch(r.lease_id, r.num_tokens, ids_from_bytes(r.block_ids), epoch,
                       ids_from_bytes(r.new_block_ids), r.num_evicted, r.alloc_error,
                       r.fetching)
            for r in resp.results]


def match_response_pb(outcomes: Iterable[LeaseMatch], epoch: str) -> pb.MatchResponse:
    """A Match's answers as its response: each LeaseMatch's fields, and the window parts of a
    WindowLeaseMatch (fields left out are the proto's defaults: the same bytes on the wire)."""
    response = pb.MatchResponse(epoch=epoch)
    add = response.results.add  # ~1.5 us less per result than building a list (upb)
    for o in outcomes:
        if isinstance(o, WindowLeaseMatch):
            add(lease_id=o.lease_id, num_tokens=o.num_tokens,
                block_ids=ids_to_bytes(o.block_ids), new_block_ids=ids_to_bytes(o.new_block_ids),
                num_evicted=o.num_evicted, alloc_error=o.alloc_error,
                window_ids=ids_to_bytes(o.window_ids),
                new_window_ids=ids_to_bytes(o.new_window_ids))
        elif o.new_block_ids or o.alloc_error or o.fetching:
            add(lease_id=o.lease_id, num_tokens=o.num_tokens,
                block_ids=ids_to_bytes(o.block_ids), new_block_ids=ids_to_bytes(o.new_block_ids),
                num_evicted=o.num_evicted, alloc_error=o.alloc_error, fetching=o.fetching)
        else:
            add(lease_id=o.lease_id, num_tokens=o.num_tokens, block_ids=ids_to_bytes(o.block_ids))
    return response


# ---- the pool layout and PoolInfo, both directions -------------------------------------------

def layout_pb(layout: KVLayout) -> pb.KVLayout:
    out = pb.KVLayout(num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                      head_dim=layout.head_dim, dtype=layout.dtype,
                      block_size=layout.block_size, bytes_per_block=layout.bytes_per_block)
    if layout.is_quantized:
        out.model_dtype, out.group_size = layout.model_dtype, layout.group_size
        out.key_scales, out.sink_tokens = layout.key_scales, layout.sink_tokens
        out.sink_bytes_per_block = layout.sink_bytes_per_block
    if layout.sliding_window is not None:
        out.sliding_window = layout.sliding_window
        out.window_layers.extend(layout.window_layers)
    return out


def layout_from_pb(q: pb.KVLayout) -> KVLayout:
    """The layout a KVLayout message describes; InvalidArgument if this client computes other
    block sizes than the service says (a block format it does not know)."""
    try:
        layout = KVLayout(q.num_layers, q.num_kv_heads, q.head_dim, q.dtype, q.block_size)
        if q.model_dtype:  # quantized
            layout = dataclasses.replace(layout, model_dtype=q.model_dtype,
                                         group_size=q.group_size, key_scales=q.key_scales,
                                         sink_tokens=q.sink_tokens)
        if q.sliding_window:  # sliding-window attention on some layers
            layout = layout.with_window(q.sliding_window, tuple(q.window_layers))
    except InvalidArgument as e:
        raise InvalidArgument(f"this client does not understand the service's pool "
                              f"layout: {e}") from None
    if (layout.bytes_per_block != q.bytes_per_block or
            (layout.sink_tokens and layout.sink_bytes_per_block != q.sink_bytes_per_block)):
        raise InvalidArgument(
            f"this client does not understand the service's pool layout: it computes "
            f"{layout.bytes_per_block} bytes per block for {layout}, the service says "
            f"{q.bytes_per_block} (a newer block format? upgrade the client)")
    return layout


def pool_info_pb(h: PoolHandle, max_tokens: int, max_batch: int, lease_ttl_s: float,
                 max_lease_ttl_s: float, table: tuple[str, int] = ("", 0),
                 peer_fetch: bool = False) -> pb.PoolInfoResponse:
    return pb.PoolInfoResponse(
        layout=layout_pb(h.layout), backend=h.backend, num_blocks=h.num_blocks,
        epoch=h.epoch, shm_name=h.name, nbytes=h.nbytes, ipc_handle=h.ipc_handle,
        device_id=h.device_id, device_uuid=h.device_uuid, strides=h.strides,
        max_tokens=max_tokens, owner_pid=h.owner_pid, max_batch=max_batch,
        lease_ttl_s=lease_ttl_s, max_lease_ttl_s=max_lease_ttl_s,
        num_sink_blocks=h.num_sink_blocks, num_window_blocks=h.num_window_blocks,
        table_name=table[0], table_nbytes=table[1], peer_fetch=peer_fetch)


def pool_info_from_pb(r: pb.PoolInfoResponse) -> PoolInfo:
    layout = layout_from_pb(r.layout)
    handle = PoolHandle.from_dict({
        "backend": r.backend, "name": r.shm_name, "nbytes": r.nbytes,
        "num_blocks": r.num_blocks, "layout": layout.to_dict(), "epoch": r.epoch,
        "ipc_handle": base64.b64encode(r.ipc_handle).decode(), "device_id": r.device_id,
        "device_uuid": r.device_uuid, "owner_pid": r.owner_pid,
        "num_sink_blocks": r.num_sink_blocks, "num_window_blocks": r.num_window_blocks,
    })
    return PoolInfo(layout, handle, r.max_tokens, r.max_batch, r.lease_ttl_s, r.max_lease_ttl_s,
                    r.table_name, r.table_nbytes, r.peer_fetch)


def tree_node_pb(n: NodeView) -> pb.TreeNode:
    return pb.TreeNode(node_id=n.node_id, parent_id=n.parent_id or 0,
                       depth_tokens=n.depth_tokens, tokens=n.tokens, block_ids=n.block_ids,
                       lock_count=n.lock_count, hits=n.hits, last_access=n.last_access,
                       window_ids=n.window_ids, block_hashes=n.block_hashes, keys=n.keys)


def node_view(n: pb.TreeNode) -> NodeView:
    return NodeView(n.node_id, n.parent_id or None, n.depth_tokens, n.tokens,
                    tuple(n.block_ids), n.lock_count, n.hits, n.last_access,
                    tuple(n.window_ids), tuple(n.block_hashes), n.keys)
