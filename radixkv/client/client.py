"""What an engine imports: typed calls to the service and the pool mapping.

    with Client() as kv:                       # default: the per-user Unix socket
        with kv.lease("llama3@rev1", prompt) as lease:
            cached = lease.num_tokens          # tokens whose KV is already in the pool
            ids = lease.allocate(n_new_blocks) # blocks to write the rest into
            scatter(lease.view(), ids, k, v)   # engine writes KV (sync first on GPU)
            lease.insert(prompt, lease.block_ids + ids)   # leaving the block releases it

KV bytes never cross gRPC: `pool()` maps the service's slab (shared memory or CUDA IPC), zero-copy.
A restart changes the pool epoch: `pool(refresh=True)` and `check_epoch()` notice and re-attach.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from kvpool import PoolMapping, attach
from radixkv.client.channel import check_health, open_channel
from radixkv.client.lease import Lease
from radixkv.client.peeks import Peeks
from radixkv.protocol import errors
from radixkv.protocol.env import check_socket_dir, client_token, normalize_target
from radixkv.protocol.errors import InvalidArgument, RadixKVError
from radixkv.protocol.tokens import ids_from_bytes, key_bytes, to_token_bytes
from radixkv.protocol.values import (
    Allocation,
    DumpPage,
    InsertResult,
    LeaseMatch,
    NodeView,
    PoolInfo,
)
from radixkv.protocol.wire import (
    STORE_ALL,
    call_credentials,
    hint_codes,
    match_results,
    message_dict,
    node_view,
    pool_info_from_pb,
    to_error,
)
from radixkv.table.reader import Peek
from radixkv.v1 import radixkv_pb2 as pb
from radixkv.v1 import radixkv_pb2_grpc

log = logging.getLogger("radixkv.client.client")

# what engines and tools import from here
__all__ = ["STORE_ALL", "Client", "Lease", "Peek", "PoolInfo", "RadixKVError", "message_dict",
           "normalize_target", "pool_info_from_pb", "to_error"]


class Client:
    """A connection to one radixkv service. Thread-safe for calls; not fork-safe (create it
    after forking)."""

    def __init__(self, target: str | None = None, client_id: str | None = None,
                 timeout: float = 30.0, max_message_bytes: int = 64 << 20,
                 token: str | None = None, tls_ca: str | None = None) -> None:
        """`token` (default $RADIXKV_AUTH_TOKEN) is sent with every call; `tls_ca` (default
        $RADIXKV_TLS_CA), a PEM file, makes the channel TLS and trusts that CA."""
        self.target = normalize_target(target)
        if self.target.startswith("unix://"):
            check_socket_dir(self.target.removeprefix("unix://"))
        self.client_id = client_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.timeout = timeout
        self._metadata = call_credentials(token or client_token())
        self._channel = open_channel(self.target, max_message_bytes, tls_ca)
        self._stub = radixkv_pb2_grpc.RadixKVStub(self._channel)  # type: ignore[no-untyped-call]
        self._mapping: PoolMapping | None = None
        self._info: PoolInfo | None = None  # of the mapped pool (None: not fetched since start)
        self._epoch: str | None = None  # the newest pool epoch any answer carried
        self._gone: set[str] = set()  # the epochs this client saw replaced by a newer one
        self.restarts = 0  # service restarts this client noticed (pool epoch changes)
        self._peeks = Peeks(lambda: self._info or self._fresh_info(), self._fresh_info)

    # ---- plumbing ----------------------------------------------------------------------------

    def _call(self, name: str, request: Any, timeout: float | None = None) -> Any:
        try:
            return getattr(self._stub, name)(request, timeout=timeout or self.timeout,
                                             metadata=self._metadata)
        except grpc.RpcError as e:
            err = to_error(e)
            if isinstance(err, errors.Unavailable) and "failed to connect" in str(err):
                raise errors.Unavailable(f"no radixkv service at {self.target} (is `radixkv "
                                         f"serve` running?): {err}") from None
            raise err from None

    def wait_ready(self, timeout: float = 20.0) -> None:
        """Block until the channel connects (raises Unavailable on timeout)."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise errors.Unavailable(f"no radixkv service at {self.target} "
                                     f"after {timeout:g} s") from None

    def close(self) -> None:
        self._peeks.close()
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- pool --------------------------------------------------------------------------------

    def pool_info(self) -> PoolInfo:
        return pool_info_from_pb(self._call("PoolInfo", pb.PoolInfoRequest()))

    def check_epoch(self) -> bool:
        """Ask the service for its pool epoch; re-attach if it changed. True if it changed."""
        info = self.pool_info()
        changed = self._epoch is not None and info.epoch != self._epoch
        if changed:
            self._forget_pool(info.epoch)
        self._info, self._epoch = info, info.epoch
        return changed

    @property
    def epoch(self) -> str | None:
        """The pool epoch this client last heard of (None before any call that carries it)."""
        return self._epoch

    def _note_epoch(self, epoch: str) -> None:
        """Match and Allocate answers carry the epoch: a new one means the service restarted,
        and their block ids belong to the new pool, so drop the old mapping now (the next
        `pool()` maps the new one; `pool_of` refuses to pair ids with another epoch's)."""
        if self._epoch is not None and epoch != self._epoch:
            self._forget_pool(epoch)
        self._epoch = epoch

    def _forget_pool(self, epoch: str) -> None:
        log.warning("radixkv service restarted (pool epoch %s -> %s): re-attaching the pool; "
                    "leases and block ids from before are gone", self._epoch, epoch)
        self.restarts += 1
        self._peeks.close()
        if self._epoch is not None:
            self._gone.add(self._epoch)
        self._info = None
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None

    def pool(self, refresh: bool = False) -> PoolMapping:
        """The service's block pool mapped into this process (zero-copy), attached once.
        Block ids are valid only in the mapping of the epoch that gave them: prefer
        `Lease.view()`, which checks, over holding this mapping's views across calls."""
        if refresh or self._info is None:
            self.check_epoch()
        if self._mapping is None:
            assert self._info is not None
            self._mapping = attach(self._info.handle)
        return self._mapping

    def _fresh_info(self) -> PoolInfo:
        self.check_epoch()
        assert self._info is not None
        return self._info

    @property
    def mapped(self) -> bool:
        """Whether this client has the pool mapped now."""
        return self._mapping is not None

    def pool_of(self, epoch: str) -> PoolMapping:
        """The pool mapping of `epoch`; StalePool if the service has restarted since (its block
        ids and KV are gone). An epoch not heard of yet (another client, e.g. a scheduler's,
        saw the restart first) costs one PoolInfo: if the service is at it, its pool is mapped."""
        mapping = self.pool()
        if mapping.epoch != epoch and epoch not in self._gone:
            self.check_epoch()
            mapping = self.pool()
        if mapping.epoch != epoch:
            raise errors.StalePool(f"pool epoch {epoch} is gone: the service restarted (now "
                                   f"{mapping.epoch}); match the prompt again")
        return mapping

    # ---- the request path --------------------------------------------------------------------

    def peek(self, namespace: str, tokens: Any) -> Peek:
        """The leading run of `tokens`' whole blocks cached in `namespace`, read from the lookup
        table in shared memory: no call (but a PoolInfo at first and after a restart), nothing
        pinned, advisory (a Match may find less). Unavailable where there is no table."""
        return self._peeks.tokens(namespace, tokens)

    def peek_keys(self, namespace: str, keys: Sequence[bytes]) -> Peek:
        """`peek` of a key path in a key-keyed namespace (as `match_keys`)."""
        return self._peeks.keys(namespace, keys)

    def match(self, namespace: str, tokens: Any, ttl: float = 0.0, store_tokens: int = 0,
              peer_fetch_async: bool = False) -> LeaseMatch:
        return self.match_many([(namespace, tokens)], ttl, store_tokens, peer_fetch_async)[0]

    def match_many(self, queries: Sequence[tuple[str, Any]], ttl: float = 0.0,
                   store_tokens: int = 0, peer_fetch_async: bool = False) -> list[LeaseMatch]:
        """One call for several prompts; each result holds its own lease (TTL `ttl` seconds
        within the server's cap; 0: the server's default). With `store_tokens` (e.g.
        STORE_ALL), each lease also gets `new_block_ids` for the uncached full blocks among
        the first store_tokens tokens, so that Allocate is not needed (or `alloc_error`).
        `peer_fetch_async`: a member's peer fetch runs meanwhile (`fetching`: ask again)."""
        req = pb.MatchRequest(client_id=self.client_id, lease_ttl_s=ttl,
                              peer_fetch_async=peer_fetch_async)
        add = req.queries.add  # ~1 us less per query than building a list (upb)
        for ns, t in queries:
            add(namespace=ns, tokens=to_token_bytes(t), store_tokens=store_tokens)
        resp = self._call("Match", req)
        self._note_epoch(resp.epoch)
        return match_results(resp)

    def match_keys(self, namespace: str, keys: Sequence[bytes], ttl: float = 0.0,
                   store: bool = False) -> LeaseMatch:
        """`match` of a sequence of opaque block keys (all of one size, 8..64 bytes, a multiple
        of 4; e.g. an engine's chain hash per block) in a key-keyed namespace: the leading run
        of keys cached, as `len(block_ids)` blocks (num_tokens: that x block_size). With
        `store`, the lease also gets `new_block_ids` for the keys past the match."""
        return self.match_keys_many([(namespace, keys)], ttl, store)[0]

    def match_keys_many(self, queries: Sequence[tuple[str, Sequence[bytes]]], ttl: float = 0.0,
                        store: bool = False) -> list[LeaseMatch]:
        """`match_keys` for several key sequences in one call, a lease each."""
        req = pb.MatchRequest(client_id=self.client_id, lease_ttl_s=ttl)
        add = req.queries.add
        for ns, keys in queries:
            data, size = key_bytes(keys)
            add(namespace=ns, keys=data, key_size=size, store_tokens=STORE_ALL if store else 0)
        resp = self._call("Match", req)
        self._note_epoch(resp.epoch)
        return match_results(resp)

    def insert_keys(self, namespace: str, keys: Sequence[bytes], block_ids: Sequence[int],
                    lease_id: int, epoch: str = "", release: bool = False,
                    hint: str | None = None) -> InsertResult:
        """`insert` of written blocks named by their keys (one id per key, in order) into a
        key-keyed namespace; num_cached_tokens counts keys already cached x block_size."""
        data, size = key_bytes(keys)
        req = pb.InsertRequest(client_id=self.client_id, items=[pb.InsertItem(
            namespace=namespace, keys=data, key_size=size, block_ids=to_token_bytes(block_ids),
            lease_id=lease_id, epoch=epoch, release=release,
            hint=hint_codes([hint], 1)[0])])
        r = self._call("Insert", req).results[0]
        return InsertResult(ids_from_bytes(r.adopted), ids_from_bytes(r.duplicates),
                            r.num_cached_tokens)

    def allocate(self, num_blocks: int, lease_id: int = 0, namespace: str = "",
                 ttl: float = 0.0, starts_sequence: bool = False,
                 num_window_blocks: int = 0, key_size: int = 0) -> Allocation:
        """`starts_sequence`: the first block will hold position 0 (a quantized pool with sink
        tokens then gives a sink block). `num_window_blocks`: window parts too (sliding-window
        pools), in `Allocation.window_ids`. `key_size`: a new lease's namespace, if new, is
        key-keyed with keys of this size."""
        resp = self._call("Allocate", pb.AllocateRequest(
            client_id=self.client_id, lease_id=lease_id, namespace=namespace,
            num_blocks=num_blocks, lease_ttl_s=ttl, starts_sequence=starts_sequence,
            num_window_blocks=num_window_blocks, key_size=key_size))
        self._note_epoch(resp.epoch)
        return Allocation(resp.lease_id, ids_from_bytes(resp.block_ids), resp.num_evicted,
                          resp.epoch, ids_from_bytes(resp.window_ids))

    def insert(self, namespace: str, tokens: Any, block_ids: Sequence[int],
               lease_id: int, epoch: str = "", release: bool = False,
               hint: str | None = None, window_ids: Sequence[int] = ()) -> InsertResult:
        return self.insert_many([(namespace, tokens, block_ids, lease_id)], epoch, release,
                                [hint], [window_ids] if window_ids else None)[0]

    def insert_many(self, items: Sequence[tuple[str, Any, Sequence[int], int]],
                    epoch: str = "", release: bool = False,
                    hints: Sequence[str | None] | None = None,
                    window_ids: Sequence[Sequence[int]] | None = None) -> list[InsertResult]:
        """Commit written blocks, all items or none. `epoch`: the pool epoch the blocks were
        allocated and written under (LeaseMatch.epoch / Allocation.epoch); the service refuses
        them with StalePool if it restarted since, so no block of a dead pool gets cached.
        `release`: end the items' leases in the same call (as `release` would). `hints`: None
        or one retention hint per item ("session_end", "keep" or None; see `release`).
        `window_ids` (sliding-window pools): None or, per item, the window parts of its last
        len(window_ids[i]) blocks."""
        codes = hint_codes(hints, len(items))
        req = pb.InsertRequest(client_id=self.client_id, items=[
            pb.InsertItem(namespace=ns, tokens=to_token_bytes(t), block_ids=to_token_bytes(ids),
                          lease_id=lid, epoch=epoch, release=release, hint=code)
            for (ns, t, ids, lid), code in zip(items, codes, strict=True)])
        if window_ids is not None:
            if len(window_ids) != len(items):
                raise InvalidArgument(f"{len(window_ids)} window-part lists for "
                                      f"{len(items)} items")
            for item, wids in zip(req.items, window_ids, strict=True):
                item.window_ids = to_token_bytes(wids)
        resp = self._call("Insert", req)
        return [InsertResult(ids_from_bytes(r.adopted), ids_from_bytes(r.duplicates),
                             r.num_cached_tokens)
                for r in resp.results]

    def release(self, *lease_ids: int, hint: str | None = None) -> int:
        """End leases; returns the number of leased-but-uninserted blocks freed. `hint`, for
        every lease: what the engine knows of the session, for the eviction policy:
        "session_end" (this prompt's unique tail will not be extended: evict it first) or
        "keep" (the session continues)."""
        codes = hint_codes([hint] * len(lease_ids) if hint else None, len(lease_ids))
        req = pb.ReleaseRequest(client_id=self.client_id, lease_ids=lease_ids,
                                hints=codes if hint else ())
        return int(self._call("Release", req).num_freed)

    def keep_alive(self, *lease_ids: int, ttl: float = 0.0) -> float:
        """Renew leases (for `ttl` seconds within the server's cap; 0: each lease's own TTL)
        without other work. Returns the shortest TTL granted."""
        req = pb.KeepAliveRequest(client_id=self.client_id, lease_ids=lease_ids, lease_ttl_s=ttl)
        return float(self._call("KeepAlive", req).ttl_s)

    def lease(self, namespace: str, tokens: Any, ttl: float = 0.0,
              store_tokens: int = STORE_ALL) -> Lease:
        """Match `tokens` (allocating for the uncached full blocks among the first
        `store_tokens`; 0: none) and hold the lease for a `with` block."""
        return Lease(self, namespace, tokens, ttl, store_tokens)

    # ---- inspection --------------------------------------------------------------------------

    def stats(self, check_integrity: bool = False, wait_s: float = 1.0) -> dict[str, Any]:
        """Counters as a dict (proto field names). With `check_integrity`, the service also
        checks its invariants and reports "ok" or the failure under "integrity"; the service
        rate-limits that check (LimitExceeded with the time to wait), and this call waits and
        asks again while the wait fits in `wait_s` seconds (0: never)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                resp = self._call("Stats", pb.StatsRequest(check_integrity=check_integrity))
                return message_dict(resp)
            except errors.LimitExceeded as e:
                wait = e.retry_after_s
                if wait is None or time.monotonic() + wait > deadline:
                    raise
                time.sleep(wait)

    def clear(self, namespace: str) -> int:
        """Drop a namespace's whole cache; returns the blocks freed. FailedPrecondition while
        any lease holds blocks in it."""
        return int(self._call("Clear", pb.ClearRequest(namespace=namespace)).num_freed)

    def dump_tree(self, namespace: str, max_depth: int = 0) -> tuple[list[NodeView], int]:
        """The whole tree at once, one snapshot (a big one may pass the message limit: page
        it with `dump_page`; key-keyed: each node's `keys`, no tokens) and the last event
        sequence it reflects."""
        resp = self._call("DumpTree", pb.DumpTreeRequest(namespace=namespace,
                                                         max_depth=max_depth))
        return [node_view(n) for n in resp.nodes], resp.last_sequence

    def dump_page(self, namespace: str, cursor: bytes = b"", page_size: int = 1024,
                  max_depth: int = 0) -> DumpPage:
        """One page of the tree after `cursor` (b"": the first; then the previous page's
        next_cursor, b"" after the last); each node carries its blocks' chained hashes. Pages
        come from different moments (radixkv/index/pages.py)."""
        resp = self._call("DumpTree", pb.DumpTreeRequest(namespace=namespace,
                                                         max_depth=max_depth,
                                                         page_size=page_size, cursor=cursor))
        return DumpPage(tuple(node_view(n) for n in resp.nodes), resp.last_sequence,
                        resp.next_cursor)

    def events(self, from_sequence: int = 0, namespace: str = "",
               timeout: float | None = None, epoch: str = "",
               opened: Callable[[], None] | None = None) -> Iterator[pb.Event]:
        """Stream of block events (from `from_sequence` if still buffered; 0: from now on),
        ending quietly after `timeout` s. An event with `lagged` set (the stream's last) means
        events were missed: rebuild from `dump_tree` and resume after its last sequence.
        Each event carries the service's epoch; resuming with `epoch` set (the one the
        sequence numbers came with) raises StalePool if the service restarted since.
        Closing the iterator (or leaving a loop over it) cancels the call. `opened` is called
        once the server runs the stream (its first response, the headers, came)."""
        call = self._stub.Events(pb.EventsRequest(from_sequence=from_sequence,
                                                  namespace=namespace, epoch=epoch),
                                 timeout=timeout, metadata=self._metadata)
        try:
            if opened is not None:
                call.initial_metadata()  # blocks until the headers, or the call's end
                if not call.done():
                    opened()
            yield from call
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise to_error(e) from None
        finally:
            call.cancel()

    def health(self, service: str = "") -> str:
        return check_health(self._channel, service, self.timeout)
