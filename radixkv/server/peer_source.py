"""The holder's side of a peer fetch: FetchBlocks offers the cached blocks of a prompt.

    FetchBlocks(namespace, tokens, start_block, max_blocks, layout)
      layout != this pool's        -> FAILED_PRECONDITION, before any byte
      Match (a lease pins the cached prefix: nothing sent can be evicted or reused meanwhile)
      blocks start_block .. cached (at most max_blocks), stopping before a sink-format block
      the offer: a data port for this fetch and a one-time ticket (radixkv/rpc/block_channel.py)
      the caller connects with the ticket: each block is sent from the pool with its checksum
      Release in `finally` (sent, broken, or the caller went away); after a whole send with
      the hint session_end: the caller has a copy, so this one goes first when the pool needs
      room (until its next hit clears the hint)

The requester (radixkv/cluster/peer_fetch.py) checks every block's checksum in its pool and
inserts only the verified leading run. Cached blocks are immutable while pinned, so the bytes
read are the bytes the tree holds for that prefix.
"""

from __future__ import annotations

import os
import ssl
import time
from collections.abc import Callable, Iterator
from typing import Any

from radixkv.protocol.errors import FailedPrecondition, InvalidArgument
from radixkv.protocol.tokens import TOKEN_BYTES
from radixkv.protocol.wire import layout_pb
from radixkv.rpc import block_channel
from radixkv.server.peers import PeerCounters
from radixkv.service import KVService
from radixkv.v1 import radixkv_pb2 as pb

SESSION_HINT = "session_end"  # radixkv.index.hints: evict these first (eviction policy adaptive)
FETCH_LEASE_TTL_S = 30.0  # the pin outlives no stream by long: released in `finally`
# Test hooks, by the prompt's block index N: CORRUPT flips one byte of block N after its
# checksum is taken (a block damaged on the way); STALL stops before block N until the caller
# goes away (a slow or dying holder mid-transfer).
CORRUPT_BLOCK_ENV = "RADIXKV_TEST_CORRUPT_FETCH_BLOCK"
STALL_BLOCK_ENV = "RADIXKV_TEST_STALL_FETCH_BLOCK"


def _hook(name: str) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else -1


class PeerSource:
    """Serves FetchBlocks from `service`'s pool (host pools: the bytes are sent in place);
    data connections on `host` (the gRPC TCP host), with `tls` when the port has it."""

    def __init__(self, service: KVService, peers: PeerCounters, host: str = "127.0.0.1",
                 tls: ssl.SSLContext | None = None) -> None:
        self.service = service
        self.peers = peers
        self.host, self.tls = host, tls
        self.layout = layout_pb(service.pool.layout)
        self._corrupt, self._stall = _hook(CORRUPT_BLOCK_ENV), _hook(STALL_BLOCK_ENV)

    def fetch(self, request: pb.FetchBlocksRequest, client: str,
              active: Callable[[], bool]) -> Iterator[pb.FetchBlocksOffer]:
        """The offer of one FetchBlocks, then the send (a generator: the pin is taken on the
        first next()); `active`: whether the caller still waits (the stream's context)."""
        if request.layout != self.layout:
            raise FailedPrecondition(
                "peer fetch refused: the caller's pool layout is not this member's "
                f"(caller: {_describe(request.layout)}; here: {_describe(self.layout)})")
        if not request.client_id:
            raise InvalidArgument("FetchBlocks needs client_id (it owns the pin)")
        bs, key_size = self.service.block_size, request.key_size
        unit = key_size or TOKEN_BYTES * bs  # bytes per block: a key, or bs token ids
        whole = len(request.tokens) // unit
        if request.start_block >= whole:
            raise InvalidArgument(f"start_block {request.start_block}: the prompt has {whole} "
                                  f"whole blocks of {bs} tokens")
        m = self.service.match(request.client_id, request.namespace,
                               request.tokens[:whole * unit], ttl_s=FETCH_LEASE_TTL_S,
                               key_size=key_size, client=client)
        sent = False
        try:
            ids = self._run(m.block_ids[request.start_block:], request.max_blocks)
            offer = pb.FetchBlocksOffer(epoch=self.service.epoch,
                                        first_block=request.start_block, num_blocks=len(ids))
            if not ids:
                yield offer
                return
            with block_channel.listen(self.host) as listener:
                offer.data_port = listener.getsockname()[1]
                offer.ticket = ticket = block_channel.new_ticket()
                yield offer
                conn = block_channel.accept(listener, ticket, self.tls, active)
            if conn is None:
                return
            with conn:
                sent = self._send(conn, request, ids, active)
        finally:
            # all sent: the caller holds a copy now, so this one is the first to evict here
            # (the hint goes at its next hit); a broken send leaves the blocks as they were
            self.service.release(request.client_id, [m.lease_id],
                                 [SESSION_HINT if sent and m.block_ids else None])

    def _run(self, block_ids: tuple[int, ...], most: int) -> list[int]:
        """The full-format leading run of `block_ids`, at most `most` (0: all)."""
        pool = self.service.pool
        ids = list(block_ids[:most] if most else block_ids)
        for n, block in enumerate(ids):  # a sink block ends the run
            if pool.is_sink(block):
                return ids[:n]
        return ids

    def _send(self, conn: Any, request: pb.FetchBlocksRequest, ids: list[int],
              active: Callable[[], bool]) -> bool:
        """Send `ids` on `conn`; whether all went (a peer that stops reading raises OSError)."""
        pool = self.service.pool

        def before(index: int) -> bool:
            while index == self._stall and active():
                time.sleep(0.05)
            return active()

        try:
            n = block_channel.send_blocks(conn, request.start_block,
                                          [pool.block_bytes(b).data for b in ids], before,
                                          self._corrupt)
        except OSError:  # the caller went away mid-send
            return False
        self.peers.sent(request.node_id or request.client_id, n,
                        n * pool.layout.bytes_per_block)
        return n == len(ids)


def _describe(layout: Any) -> str:
    return (f"{layout.num_layers} layers x {layout.num_kv_heads} kv heads x {layout.head_dim}, "
            f"{layout.dtype}, blocks of {layout.block_size} tokens, {layout.bytes_per_block} B"
            + (f", window {layout.sliding_window}" if layout.sliding_window else ""))
