"""The values that cross between an engine and the service: a Match's and an Allocate's answers,
an Insert's item and result, a tree node's snapshot, the service's figures, and the pool a
client maps. Frozen; nothing here imports the service, the server or the index, so the client
side stands on this alone.

`InsertResult` and `NodeView` have the fields of radixkv.index.tree's (the service returns the
tree's own; a client builds these from the wire)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

    from kvpool.base import PoolHandle
    from kvpool.layout import KVLayout


@dataclass(frozen=True, slots=True)
class LeaseMatch:
    """A Match's answer: the lease pinning `block_ids`, which hold the first `num_tokens`."""

    lease_id: int
    num_tokens: int
    block_ids: tuple[int, ...]
    epoch: str = ""  # the pool's epoch: block ids are valid only in its mapping
    new_block_ids: tuple[int, ...] = ()  # allocated for the rest (a match with store_tokens)
    num_evicted: int = 0  # blocks evicted for new_block_ids
    alloc_error: str = ""  # why a match with store_tokens allocated nothing
    fetching: bool = False  # a peer's blocks of this prompt are on their way (ask again)


@dataclass(frozen=True, slots=True)
class WindowLeaseMatch(LeaseMatch):
    """A Match's answer on a sliding-window pool (a subclass: the full-attention path builds
    no more fields): the window parts of the last min(blocks, window_blocks) matched blocks,
    and (store_tokens) new window parts for the last blocks of the stored range, HOLE where none
    is needed: the new tail's last window_blocks blocks, and the blocks before the end of the
    cached full parts whose window parts are missing (a branch point: resumable next time)."""

    window_ids: tuple[int, ...] = ()
    new_window_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Allocation:
    """Blocks leased to `lease_id`; `num_evicted` blocks were evicted to make room."""

    lease_id: int
    block_ids: tuple[int, ...]
    num_evicted: int
    epoch: str = ""  # the pool's epoch: block ids are valid only in its mapping
    window_ids: tuple[int, ...] = ()  # window parts (windowed pools)


@dataclass(frozen=True, slots=True)
class MatchQuery:
    """One query of a Match: a namespace's token ids, or its block keys of key_size bytes."""

    namespace: str
    data: bytes
    key_size: int = 0


@dataclass(frozen=True, slots=True)
class InsertItem:
    """One item of an Insert, as decoded from the wire and passed unchanged to the service:
    `block_ids` (one per full block of `tokens`) leased to `lease_id` or already cached there,
    committed into `namespace`'s tree."""

    lease_id: int
    namespace: str
    tokens: bytes  # token ids (little-endian uint32), or block keys where key_size
    block_ids: Sequence[int]
    hint: str | int | None = None  # a retention hint for the node where tokens end
    window_ids: Sequence[int] = ()  # windowed pools: window parts of the last blocks (HOLE: none)
    key_size: int = 0  # key-keyed namespaces: tokens are block keys of this many bytes


@dataclass(frozen=True, slots=True)
class InsertResult:
    adopted: tuple[int, ...]  # now owned by the tree
    duplicates: tuple[int, ...]  # a different block already caches that prefix: freed
    num_cached_tokens: int  # tokens of the prefix that was cached before the call


@dataclass(frozen=True, slots=True)
class NodeView:
    node_id: int
    parent_id: int | None  # None for children of the root
    depth_tokens: int  # tokens from the root to the end of this edge
    tokens: bytes  # this edge
    block_ids: tuple[int, ...]
    lock_count: int
    hits: int
    last_access: float  # time.time() of the last touch
    window_ids: tuple[int, ...] = ()  # windowed trees: each block's window part (HOLE: none)
    block_hashes: tuple[int, ...] = ()  # paged dumps: each block's chained hash (as events)
    keys: bytes = b""  # key-keyed namespaces (tokens empty): this edge's block keys


@dataclass(frozen=True, slots=True)
class DumpPage:
    """One page of a namespace's tree (radixkv/index/pages.py says which nodes and in what
    order): `next_cursor` asks for the next page, b"" after the last."""

    nodes: tuple[NodeView, ...]
    last_sequence: int  # events up to this number are reflected in this page
    next_cursor: bytes


@dataclass(frozen=True, slots=True)
class NamespaceStats:
    namespace: str
    cached_blocks: int
    nodes: int
    requests: int
    query_tokens: int
    hit_tokens: int
    evicted_blocks: int
    key_size: int = 0  # key-keyed namespaces: bytes per block key (0: token-keyed)


@dataclass(frozen=True, slots=True)
class DiskStats:
    """The disk tier below the pool (all 0 without one; radixkv/disk/tier.py)."""

    capacity_blocks: int = 0
    blocks: int = 0  # blocks on disk (hittable)
    bytes: int = 0  # their payload bytes
    slot_bytes: int = 0  # one slot on disk (header + payload)
    hit_tokens: int = 0  # of the hit tokens, those promoted from disk for the hit
    promoted_blocks: int = 0
    demoted_blocks: int = 0
    evicted_blocks: int = 0  # dropped from the disk tier to make room
    verify_failures: int = 0  # slots that failed their checksum when read: a miss, never served
    pending_writes: int = 0  # demotions whose write is queued (served from memory until done)
    loaded_blocks: int = 0  # found on disk at start (a warm restart)
    dropped_at_load: int = 0  # slots found torn or not verifying at start
    generation: int = 0  # service starts on this tier's file
    state: str = ""  # "ok"; "failing": its writes fail and are retried (demotions dropped)
    last_error: str = ""  # the last write or fsync error ("" if none since the start)
    write_errors: int = 0  # failed writes and fsyncs (each retry that fails counts)


@dataclass(frozen=True, slots=True)
class ServiceStats:
    num_blocks: int
    free_blocks: int
    leased_blocks: int
    cached_blocks: int
    pinned_blocks: int
    live_leases: int
    expired_leases: int
    requests: int
    query_tokens: int
    hit_tokens: int
    recent_requests: int
    recent_query_tokens: int
    recent_hit_tokens: int
    evicted_blocks: int
    uptime_s: float
    namespaces: tuple[NamespaceStats, ...]
    backend: str  # the pool's
    epoch: str
    layout: KVLayout
    event_sequence: int = 0  # the last event published when these figures were read
    # windowed pools: window parts (num_blocks and the block counts above count full parts)
    window_blocks: int = 0
    free_window_blocks: int = 0
    cached_window_blocks: int = 0
    disk: DiskStats = DiskStats()


@dataclass(frozen=True, slots=True)
class PoolInfo:
    layout: KVLayout
    handle: PoolHandle
    max_tokens: int
    max_batch: int = 0  # most queries / items / ids per call (0: an older server, unknown)
    lease_ttl_s: float = 0.0
    max_lease_ttl_s: float = 0.0
    table_name: str = ""  # the lookup table's segment ("": none published)
    table_nbytes: int = 0
    peer_fetch: bool = False  # a Match may bring blocks from other members

    @property
    def epoch(self) -> str:
        return self.handle.epoch
