"""The holder's side of a peer fetch: FetchBlocks streams the cached blocks of a prompt.

    FetchBlocks(namespace, tokens, start_block, layout)
      layout != this pool's        -> FAILED_PRECONDITION, before any byte
      Match (a lease pins the cached prefix: nothing sent can be evicted or reused meanwhile)
      blocks start_block .. cached, stopping before a sink-format block
      chunks of whole blocks (chunk_bytes, default 4 MiB): bytes + one CRC-32 per block
      Release in `finally` (the stream ended, broke, or the caller went away); after a whole
      send with the hint session_end: the caller has a copy, so this one goes first when the
      pool needs room (until its next hit clears the hint)

The requester (radixkv/cluster/peer_fetch.py) checks every block's CRC before it writes it into
its pool and inserts only the verified leading run. Cached blocks are immutable while pinned, so
the bytes read are the bytes the tree holds for that prefix.
"""

from __future__ import annotations

import os
import time
import zlib
from collections.abc import Callable, Iterator
from typing import Any

from radixkv.protocol.errors import FailedPrecondition, InvalidArgument
from radixkv.protocol.tokens import TOKEN_BYTES
from radixkv.protocol.wire import layout_pb
from radixkv.server.peers import PeerCounters
from radixkv.service import KVService
from radixkv.v1 import radixkv_pb2 as pb

SESSION_HINT = "session_end"  # radixkv.index.hints: evict these first (eviction policy adaptive)
DEFAULT_CHUNK_BYTES = 4 << 20
MIN_CHUNK_BYTES = 64 << 10
FETCH_LEASE_TTL_S = 30.0  # the pin outlives no stream by long: released in `finally`
# Test hooks, by the prompt's block index N: CORRUPT flips one byte of block N after its CRC is
# taken (a chunk damaged on the way); STALL sends one block per chunk and stops before block N
# until the caller goes away (a slow or dying holder mid-transfer).
CORRUPT_BLOCK_ENV = "RADIXKV_TEST_CORRUPT_FETCH_BLOCK"
STALL_BLOCK_ENV = "RADIXKV_TEST_STALL_FETCH_BLOCK"


def _hook(name: str) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else -1


class PeerSource:
    """Serves FetchBlocks from `service`'s pool (host pools: the bytes are read in place)."""

    def __init__(self, service: KVService, peers: PeerCounters) -> None:
        self.service = service
        self.peers = peers
        self.layout = layout_pb(service.pool.layout)
        self._corrupt, self._stall = _hook(CORRUPT_BLOCK_ENV), _hook(STALL_BLOCK_ENV)

    def fetch(self, request: pb.FetchBlocksRequest, client: str,
              active: Callable[[], bool]) -> Iterator[pb.FetchBlocksChunk]:
        """The chunks of one FetchBlocks (a generator: the pin is taken on the first next());
        `active`: whether the caller still waits (the stream's context)."""
        if request.layout != self.layout:
            raise FailedPrecondition(
                "peer fetch refused: the caller's pool layout is not this member's "
                f"(caller: {_describe(request.layout)}; here: {_describe(self.layout)})")
        if not request.client_id:
            raise InvalidArgument("FetchBlocks needs client_id (it owns the pin)")
        bs = self.service.block_size
        whole = len(request.tokens) // (TOKEN_BYTES * bs)
        if request.start_block >= whole:
            raise InvalidArgument(f"start_block {request.start_block}: the prompt has {whole} "
                                  f"whole blocks of {bs} tokens")
        tokens = request.tokens[:whole * bs * TOKEN_BYTES]
        chunk = max(MIN_CHUNK_BYTES, request.chunk_bytes or DEFAULT_CHUNK_BYTES)
        m = self.service.match(request.client_id, request.namespace, tokens,
                               ttl_s=FETCH_LEASE_TTL_S, client=client)
        sent = False
        try:
            yield from self._chunks(request, m.block_ids, chunk, active)
            sent = True
        finally:
            # all sent: the caller holds a copy now, so this one is the first to evict here
            # (the hint goes at its next hit); a broken stream leaves the blocks as they were
            self.service.release(request.client_id, [m.lease_id],
                                 [SESSION_HINT if sent and m.block_ids else None])

    def _chunks(self, request: pb.FetchBlocksRequest, block_ids: tuple[int, ...],
                chunk_bytes: int, active: Callable[[], bool]) -> Iterator[pb.FetchBlocksChunk]:
        pool = self.service.pool
        ids = list(block_ids[request.start_block:])
        for n, block in enumerate(ids):  # full-format blocks only: a sink block ends the run
            if pool.is_sink(block):
                ids = ids[:n]
                break
        epoch, bpb = self.service.epoch, pool.layout.bytes_per_block
        per_chunk = 1 if self._stall >= 0 else max(1, chunk_bytes // bpb)
        if not ids:
            yield pb.FetchBlocksChunk(epoch=epoch, first_block=request.start_block)
            return
        for start in range(0, len(ids), per_chunk):
            while request.start_block + start == self._stall and active():
                time.sleep(0.05)
            views = [pool.block_bytes(b).data for b in ids[start:start + per_chunk]]
            crcs = [zlib.crc32(v) for v in views]
            data = b"".join(views)  # the one copy: the message needs its own bytes
            first = request.start_block + start
            if 0 <= self._corrupt - first < len(views):
                at = (self._corrupt - first) * bpb
                data = data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:]
            yield pb.FetchBlocksChunk(epoch=epoch, first_block=first, data=data, crc32=crcs,
                                      num_blocks=len(ids) if start == 0 else 0)
            self.peers.sent(request.node_id or request.client_id, len(views), len(data))


def _describe(layout: Any) -> str:
    return (f"{layout.num_layers} layers x {layout.num_kv_heads} kv heads x {layout.head_dim}, "
            f"{layout.dtype}, blocks of {layout.block_size} tokens, {layout.bytes_per_block} B"
            + (f", window {layout.sliding_window}" if layout.sliding_window else ""))
