"""What a `radixkv replay` client process does per request: drive the service as an engine would
(radixkv.replay.sender runs the process's loop over the job queue).

Per request (a job from the shared queue, in trace order):

    (verified runs: peek(ns, tokens), the lookup table's answer, as an engine's fast path
     reads it; the report counts the blocks it gave that the Match then did not find)
    Match(ns, tokens)            -> lease pins the cached prefix; its blocks are read back
                                    through the pool mapping and checked (verification)
    Allocate(lease, rest)        -> new blocks; on OutOfBlocks, as many as are free or
                                    evictable (Stats), as replay_tree takes what it can have
    write keys into the blocks   -> first 8 bytes of each: block_keys() of its prefix
    Insert(ns, tokens, ids)      -> every request with a full block, even when none is new: it
                                    counts the request's end (the adaptive policy's lineage)
    Release(lease)                  and carries the request's retention hint, if the replay has
                                    hints (else Release does)

Each full block's key is a 64-bit chained hash of namespace + token prefix (blake2b), so a hit
block that holds anything but its own prefix's bytes is a mismatch.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from radixkv.protocol.errors import InvalidArgument, OutOfBlocks, RadixKVError
from radixkv.protocol.limits import HOLE
from radixkv.protocol.tokens import block_bytes, num_tokens

_PERSON = b"radixkv-replay"


def block_keys(namespace: str, tokens: bytes, block_size: int) -> np.ndarray[Any, Any]:
    """uint64 key of each full block: a chained blake2b of namespace + the token prefix up to
    the block's end. Equal keys <=> equal namespace and prefix (up to 64-bit collisions)."""
    bb = block_bytes(block_size)
    h = hashlib.blake2b(namespace.encode(), digest_size=8, person=_PERSON).digest()
    view, digests = memoryview(tokens), []
    for start in range(0, len(tokens) - bb + 1, bb):
        d = hashlib.blake2b(h, digest_size=8, person=_PERSON)
        d.update(view[start : start + bb])
        h = d.digest()
        digests.append(h)
    return np.frombuffer(b"".join(digests), dtype="<u8")


@dataclass(frozen=True, slots=True)
class ClientArgs:
    target: str
    block_size: int
    capacity_blocks: int  # per service (per member in a cluster)
    verify: bool
    speed: float
    round_trips: int = 2  # 2: Match allocates and Insert releases; 4: the four-call path
    window_blocks: int = 0  # a sliding-window pool: blocks a resume needs window parts of
    router: str = ""  # a cluster: choose each request's member (radixkv.replay.routing)
    routing: str = "cache-aware"


class BlockBytes:
    """The pool's blocks as bytes, through the client's pool mapping (numpy on host pools,
    torch on cuda): first 8 bytes of each block read and written as uint64."""

    def __init__(self, mapping: Any) -> None:
        n, bpb = mapping.num_regular_blocks, mapping.layout.bytes_per_block
        self.epoch = mapping.epoch
        if bpb < 8:
            raise InvalidArgument(f"verification needs >= 8 bytes per block, the pool has {bpb}")
        self.torch = (mapping.backend != "host" or mapping.num_sink_blocks > 0
                      or mapping.num_window_blocks > 0)
        self.bytes: Any
        self.windows: BlockBytes | None = None  # a sliding-window pool's window parts
        if mapping.num_window_blocks:  # two regions: full parts, then window parts
            full = mapping.view()
            self.bytes = _rows(full) if full.numel() else None  # all-windowed: no bytes
            self.windows = BlockBytes.__new__(BlockBytes)
            self.windows.epoch, self.windows.torch, self.windows.windows = self.epoch, True, None
            self.windows.bytes = _Offset(_rows(mapping.window_view()), mapping.num_full_blocks)
        elif mapping.num_sink_blocks:  # the sink region's rows after the regular ones
            self.bytes = _Rows(mapping.view(), mapping.sink_view())
        elif self.torch:
            import torch

            t = mapping.view()
            self.bytes = t.reshape(n, -1).view(torch.uint8) if t.dim() > 2 else t
        else:
            self.bytes = mapping.numpy_view().reshape(n, -1).view(np.uint8)

    def write(self, ids: tuple[int, ...], keys: np.ndarray[Any, Any]) -> None:
        rows = keys.astype("<u8").view(np.uint8).reshape(-1, 8)
        if self.torch:
            import torch

            idx = torch.tensor(ids, device=self.bytes.device)
            self.bytes[idx, :8] = torch.from_numpy(rows.copy()).to(self.bytes.device)
            if self.bytes.device.type == "cuda":
                torch.cuda.synchronize(self.bytes.device)  # written before Insert says so
        else:
            self.bytes[list(ids), :8] = rows

    def read(self, ids: tuple[int, ...]) -> np.ndarray[Any, Any]:
        if self.torch:
            import torch

            rows = self.bytes[torch.tensor(ids, device=self.bytes.device), :8].cpu().numpy()
        else:
            rows = self.bytes[list(ids), :8]
        return np.ascontiguousarray(rows).view("<u8").ravel()


def _rows(t: Any) -> Any:
    """A typed block tensor [blocks, ...] as uint8 rows [blocks, bytes]."""
    import torch

    return t.reshape(t.shape[0], -1).view(torch.uint8)


class _Offset:
    """Rows addressed by global block ids starting at `first` (a pool's window parts)."""

    def __init__(self, rows: Any, first: int) -> None:
        self.rows, self.first, self.device = rows, first, rows.device

    def __setitem__(self, key: Any, rows: Any) -> None:
        idx, cols = key
        self.rows[idx - self.first, cols] = rows

    def __getitem__(self, key: Any) -> Any:
        idx, cols = key
        return self.rows[idx - self.first, cols]


class _Rows:
    """Two uint8 row tensors (a pool's regular and sink regions) indexed as one, first 8
    bytes only: enough for BlockBytes."""

    def __init__(self, regular: Any, sink: Any) -> None:
        self.regular, self.sink, self.split = regular, sink, regular.shape[0]
        self.device = regular.device

    def __setitem__(self, key: Any, rows: Any) -> None:
        idx, _ = key
        for pos, i in enumerate(idx.tolist()):
            target = self.regular[i] if i < self.split else self.sink[i - self.split]
            target[:8] = rows[pos]

    def __getitem__(self, key: Any) -> Any:
        import torch

        idx, _ = key
        return torch.stack([(self.regular[i] if i < self.split else self.sink[i - self.split])[:8]
                            for i in idx.tolist()])


def _allocate(kv: Any, lease_id: int, want: int) -> tuple[int, ...]:
    """Up to `want` blocks for the lease: all of them, or on OutOfBlocks as many as are free or
    evictable now (Stats), retried a few times when other clients race us; () if none."""
    for _ in range(8):
        if want <= 0:
            return ()
        try:
            return tuple(kv.allocate(want, lease_id=lease_id).block_ids)
        except OutOfBlocks:
            st = kv.stats()
            have = st["free_blocks"] + st["cached_blocks"] - st["pinned_blocks"]
            if have >= want:  # someone else held them a moment ago: try again
                time.sleep(0.001)
            want = min(want, have)
    return ()


@dataclass
class Verification:
    """Hit blocks checked against their keys, across the requests of one client; and the
    lookup table's answers against the Matches (`peek`: while the table can be read here)."""

    verified: int = 0
    mismatches: int = 0
    examples: list[str] = field(default_factory=list)
    peek: bool = True


def _peek(kv: Any, check: Verification, namespace: str, tokens: bytes) -> int:
    """The blocks of `tokens` the service's lookup table holds, read as an engine's fast path
    reads them before it pins (the Match); 0, and no more reads, where this process cannot
    read the table (none published, a service on another host)."""
    if not check.peek:
        return 0
    try:
        return int(kv.peek(namespace, tokens).num_blocks)
    except RadixKVError:
        check.peek = False
        return 0


def request(args: ClientArgs, kv: Any, pool: BlockBytes | None, *, check: Verification,
             index: int, namespace: str, tokens: bytes,
             keys: np.ndarray[Any, Any], hint: str | None = None) -> dict[str, int]:
    """One request against one service, as an engine drives it; returns its record. The
    verification counts are added only once the request completed (a retried request
    counts once)."""
    bb, clock = block_bytes(args.block_size), time.perf_counter_ns
    verified = mismatches = 0
    examples: list[str] = []
    alloc_ns = insert_ns = match_ns = release_ns = -1
    new: tuple[int, ...] = ()
    hit = need = 0
    peeked = _peek(kv, check, namespace, tokens) if args.verify and tokens else 0
    if tokens:
        two = args.round_trips == 2
        t = clock()
        m = kv.match(namespace, tokens, store_tokens=num_tokens(tokens) if two else 0)
        match_ns = clock() - t
        hit = m.num_tokens
        matched = len(m.block_ids)
        checks: list[tuple[Any, tuple[int, ...], int]] = []  # (region, ids, first block)
        if pool is not None and matched:
            if pool.bytes is not None:
                checks.append((pool, m.block_ids, 0))
            if pool.windows is not None:
                wins = getattr(m, "window_ids", ())
                checks.append((pool.windows, wins, matched - len(wins)))
        for region, ids, first in checks:
            got = region.read(ids)
            bad = np.flatnonzero(got != keys[first:first + len(ids)])
            verified += len(ids)
            mismatches += int(bad.size)
            for i in bad[: max(0, 5 - len(examples))]:
                examples.append(f"request {index} block {first + i} (pool id {ids[i]}): "
                                f"expected {int(keys[first + i]):#018x}, "
                                f"read {int(got[i]):#018x}")
        need = len(tokens) // bb - matched
        new = m.new_block_ids
        windows = getattr(m, "new_window_ids", ())  # sliding-window pools: see LeaseMatch
        if need > 0 and not new and not args.window_blocks:  # four calls, or no room yet
            # (a sliding-window pool replays on two round trips; without room it stores none)
            t = clock()
            new = _allocate(kv, m.lease_id, min(need, args.capacity_blocks))
            alloc_ns = clock() - t
        if new and pool is not None:
            end = matched + len(new)
            if pool.bytes is not None:
                pool.write(new, keys[matched:end])
            if pool.windows is not None and windows:  # aligned to the end; HOLE: none
                at = [i for i, w in enumerate(windows) if w != HOLE]
                pool.windows.write(tuple(windows[i] for i in at),
                                   keys[end - len(windows):end][at])
        inserted = bool(new or matched)
        if inserted:
            t = clock()
            kv.insert(namespace, tokens[: (matched + len(new)) * bb], m.block_ids + new,
                      m.lease_id, m.epoch, release=two, hint=hint,
                      window_ids=windows if new else ())
            insert_ns = clock() - t
        if not (inserted and two):
            t = clock()
            kv.release(m.lease_id, hint=None if inserted else hint)
            release_ns = clock() - t
    check.verified += verified
    check.mismatches += mismatches
    check.examples.extend(examples[: max(0, 5 - len(check.examples))])
    return {"hit_tokens": hit, "match_ns": match_ns, "allocate_ns": alloc_ns,
            "insert_ns": insert_ns, "release_ns": release_ns, "dropped": need - len(new),
            "peek_blocks": peeked}

