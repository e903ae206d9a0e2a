from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RetentionHint(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RETENTION_HINT_NONE: _ClassVar[RetentionHint]
    RETENTION_HINT_SESSION_END: _ClassVar[RetentionHint]
    RETENTION_HINT_KEEP: _ClassVar[RetentionHint]
RETENTION_HINT_NONE: RetentionHint
RETENTION_HINT_SESSION_END: RetentionHint
RETENTION_HINT_KEEP: RetentionHint

class KVLayout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "dtype", "block_size", "bytes_per_block", "model_dtype", "group_size", "key_scales", "sink_tokens", "sink_bytes_per_block", "sliding_window", "window_layers")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    MODEL_DTYPE_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    KEY_SCALES_FIELD_NUMBER: _ClassVar[int]
    SINK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SINK_BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    WINDOW_LAYERS_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    bytes_per_block: int
    model_dtype: str
    group_size: int
    key_scales: str
    sink_tokens: int
    sink_bytes_per_block: int
    sliding_window: int
    window_layers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., bytes_per_block: _Optional[int] = ..., model_dtype: _Optional[str] = ..., group_size: _Optional[int] = ..., key_scales: _Optional[str] = ..., sink_tokens: _Optional[int] = ..., sink_bytes_per_block: _Optional[int] = ..., sliding_window: _Optional[int] = ..., window_layers: _Optional[_Iterable[int]] = ...) -> None: ...

class PoolInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolInfoResponse(_message.Message):
    __slots__ = ("layout", "backend", "num_blocks", "epoch", "shm_name", "nbytes", "ipc_handle", "device_id", "device_uuid", "strides", "max_tokens", "owner_pid", "max_batch", "lease_ttl_s", "max_lease_ttl_s", "num_sink_blocks", "num_window_blocks", "table_name", "table_nbytes", "peer_fetch")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    STRIDES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OWNER_PID_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    MAX_LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    NUM_SINK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_WINDOW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TABLE_NAME_FIELD_NUMBER: _ClassVar[int]
    TABLE_NBYTES_FIELD_NUMBER: _ClassVar[int]
    PEER_FETCH_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayout
    backend: str
    num_blocks: int
    epoch: str
    shm_name: str
    nbytes: int
    ipc_handle: bytes
    device_id: int
    device_uuid: str
    strides: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    owner_pid: int
    max_batch: int
    lease_ttl_s: float
    max_lease_ttl_s: float
    num_sink_blocks: int
    num_window_blocks: int
    table_name: str
    table_nbytes: int
    peer_fetch: bool
    def __init__(self, layout: _Optional[_Union[KVLayout, _Mapping]] = ..., backend: _Optional[str] = ..., num_blocks: _Optional[int] = ..., epoch: _Optional[str] = ..., shm_name: _Optional[str] = ..., nbytes: _Optional[int] = ..., ipc_handle: _Optional[bytes] = ..., device_id: _Optional[int] = ..., device_uuid: _Optional[str] = ..., strides: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., owner_pid: _Optional[int] = ..., max_batch: _Optional[int] = ..., lease_ttl_s: _Optional[float] = ..., max_lease_ttl_s: _Optional[float] = ..., num_sink_blocks: _Optional[int] = ..., num_window_blocks: _Optional[int] = ..., table_name: _Optional[str] = ..., table_nbytes: _Optional[int] = ..., peer_fetch: _Optional[bool] = ...) -> None: ...

class MatchQuery(_message.Message):
    __slots__ = ("namespace", "tokens", "store_tokens", "keys", "key_size")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STORE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KEY_SIZE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    tokens: bytes
    store_tokens: int
    keys: bytes
    key_size: int
    def __init__(self, namespace: _Optional[str] = ..., tokens: _Optional[bytes] = ..., store_tokens: _Optional[int] = ..., keys: _Optional[bytes] = ..., key_size: _Optional[int] = ...) -> None: ...

class MatchRequest(_message.Message):
    __slots__ = ("client_id", "queries", "lease_ttl_s", "peer_fetch_async")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    PEER_FETCH_ASYNC_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    queries: _containers.RepeatedCompositeFieldContainer[MatchQuery]
    lease_ttl_s: float
    peer_fetch_async: bool
    def __init__(self, client_id: _Optional[str] = ..., queries: _Optional[_Iterable[_Union[MatchQuery, _Mapping]]] = ..., lease_ttl_s: _Optional[float] = ..., peer_fetch_async: _Optional[bool] = ...) -> None: ...

class MatchResult(_message.Message):
    __slots__ = ("lease_id", "num_tokens", "block_ids", "new_block_ids", "num_evicted", "alloc_error", "window_ids", "new_window_ids", "fetching")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTED_FIELD_NUMBER: _ClassVar[int]
    ALLOC_ERROR_FIELD_NUMBER: _ClassVar[int]
    WINDOW_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_WINDOW_IDS_FIELD_NUMBER: _ClassVar[int]
    FETCHING_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    num_tokens: int
    block_ids: bytes
    new_block_ids: bytes
    num_evicted: int
    alloc_error: str
    window_ids: bytes
    new_window_ids: bytes
    fetching: bool
    def __init__(self, lease_id: _Optional[int] = ..., num_tokens: _Optional[int] = ..., block_ids: _Optional[bytes] = ..., new_block_ids: _Optional[bytes] = ..., num_evicted: _Optional[int] = ..., alloc_error: _Optional[str] = ..., window_ids: _Optional[bytes] = ..., new_window_ids: _Optional[bytes] = ..., fetching: _Optional[bool] = ...) -> None: ...

class MatchResponse(_message.Message):
    __slots__ = ("results", "epoch")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[MatchResult]
    epoch: str
    def __init__(self, results: _Optional[_Iterable[_Union[MatchResult, _Mapping]]] = ..., epoch: _Optional[str] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("client_id", "lease_id", "namespace", "num_blocks", "lease_ttl_s", "starts_sequence", "num_window_blocks", "key_size")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    STARTS_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    NUM_WINDOW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KEY_SIZE_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    lease_id: int
    namespace: str
    num_blocks: int
    lease_ttl_s: float
    starts_sequence: bool
    num_window_blocks: int
    key_size: int
    def __init__(self, client_id: _Optional[str] = ..., lease_id: _Optional[int] = ..., namespace: _Optional[str] = ..., num_blocks: _Optional[int] = ..., lease_ttl_s: _Optional[float] = ..., starts_sequence: _Optional[bool] = ..., num_window_blocks: _Optional[int] = ..., key_size: _Optional[int] = ...) -> None: ...

class AllocateResponse(_message.Message):
    __slots__ = ("lease_id", "block_ids", "num_evicted", "epoch", "window_ids")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    WINDOW_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    block_ids: bytes
    num_evicted: int
    epoch: str
    window_ids: bytes
    def __init__(self, lease_id: _Optional[int] = ..., block_ids: _Optional[bytes] = ..., num_evicted: _Optional[int] = ..., epoch: _Optional[str] = ..., window_ids: _Optional[bytes] = ...) -> None: ...

class InsertItem(_message.Message):
    __slots__ = ("lease_id", "namespace", "tokens", "block_ids", "epoch", "release", "hint", "window_ids", "keys", "key_size")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    HINT_FIELD_NUMBER: _ClassVar[int]
    WINDOW_IDS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KEY_SIZE_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    namespace: str
    tokens: bytes
    block_ids: bytes
    epoch: str
    release: bool
    hint: RetentionHint
    window_ids: bytes
    keys: bytes
    key_size: int
    def __init__(self, lease_id: _Optional[int] = ..., namespace: _Optional[str] = ..., tokens: _Optional[bytes] = ..., block_ids: _Optional[bytes] = ..., epoch: _Optional[str] = ..., release: _Optional[bool] = ..., hint: _Optional[_Union[RetentionHint, str]] = ..., window_ids: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., key_size: _Optional[int] = ...) -> None: ...

class InsertRequest(_message.Message):
    __slots__ = ("client_id", "items")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    items: _containers.RepeatedCompositeFieldContainer[InsertItem]
    def __init__(self, client_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[InsertItem, _Mapping]]] = ...) -> None: ...

class InsertResult(_message.Message):
    __slots__ = ("adopted", "duplicates", "num_cached_tokens", "num_freed")
    ADOPTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREED_FIELD_NUMBER: _ClassVar[int]
    adopted: bytes
    duplicates: bytes
    num_cached_tokens: int
    num_freed: int
    def __init__(self, adopted: _Optional[bytes] = ..., duplicates: _Optional[bytes] = ..., num_cached_tokens: _Optional[int] = ..., num_freed: _Optional[int] = ...) -> None: ...

class InsertResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[InsertResult]
    def __init__(self, results: _Optional[_Iterable[_Union[InsertResult, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("client_id", "lease_ids", "hints")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    HINTS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    lease_ids: _containers.RepeatedScalarFieldContainer[int]
    hints: _containers.RepeatedScalarFieldContainer[RetentionHint]
    def __init__(self, client_id: _Optional[str] = ..., lease_ids: _Optional[_Iterable[int]] = ..., hints: _Optional[_Iterable[_Union[RetentionHint, str]]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("num_freed",)
    NUM_FREED_FIELD_NUMBER: _ClassVar[int]
    num_freed: int
    def __init__(self, num_freed: _Optional[int] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("client_id", "lease_ids", "lease_ttl_s")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    lease_ids: _containers.RepeatedScalarFieldContainer[int]
    lease_ttl_s: float
    def __init__(self, client_id: _Optional[str] = ..., lease_ids: _Optional[_Iterable[int]] = ..., lease_ttl_s: _Optional[float] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("ttl_s",)
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    ttl_s: float
    def __init__(self, ttl_s: _Optional[float] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("check_integrity",)
    CHECK_INTEGRITY_FIELD_NUMBER: _ClassVar[int]
    check_integrity: bool
    def __init__(self, check_integrity: _Optional[bool] = ...) -> None: ...

class NamespaceStats(_message.Message):
    __slots__ = ("namespace", "cached_blocks", "cached_tokens", "nodes", "requests", "query_tokens", "hit_tokens", "evicted_blocks", "key_size")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KEY_SIZE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    cached_blocks: int
    cached_tokens: int
    nodes: int
    requests: int
    query_tokens: int
    hit_tokens: int
    evicted_blocks: int
    key_size: int
    def __init__(self, namespace: _Optional[str] = ..., cached_blocks: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., nodes: _Optional[int] = ..., requests: _Optional[int] = ..., query_tokens: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., evicted_blocks: _Optional[int] = ..., key_size: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("backend", "layout", "num_blocks", "free_blocks", "leased_blocks", "cached_blocks", "pinned_blocks", "live_leases", "expired_leases", "requests", "query_tokens", "hit_tokens", "recent_requests", "recent_query_tokens", "recent_hit_tokens", "evicted_blocks", "uptime_s", "epoch", "namespaces", "integrity", "event_sequence", "window_blocks", "free_window_blocks", "cached_window_blocks", "disk", "peers")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_LEASES_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECENT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RECENT_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECENT_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_FIELD_NUMBER: _ClassVar[int]
    EVENT_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_WINDOW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_WINDOW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    backend: str
    layout: KVLayout
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
    epoch: str
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceStats]
    integrity: str
    event_sequence: int
    window_blocks: int
    free_window_blocks: int
    cached_window_blocks: int
    disk: DiskStats
    peers: _containers.RepeatedCompositeFieldContainer[PeerStats]
    def __init__(self, backend: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., num_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., leased_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., pinned_blocks: _Optional[int] = ..., live_leases: _Optional[int] = ..., expired_leases: _Optional[int] = ..., requests: _Optional[int] = ..., query_tokens: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., recent_requests: _Optional[int] = ..., recent_query_tokens: _Optional[int] = ..., recent_hit_tokens: _Optional[int] = ..., evicted_blocks: _Optional[int] = ..., uptime_s: _Optional[float] = ..., epoch: _Optional[str] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceStats, _Mapping]]] = ..., integrity: _Optional[str] = ..., event_sequence: _Optional[int] = ..., window_blocks: _Optional[int] = ..., free_window_blocks: _Optional[int] = ..., cached_window_blocks: _Optional[int] = ..., disk: _Optional[_Union[DiskStats, _Mapping]] = ..., peers: _Optional[_Iterable[_Union[PeerStats, _Mapping]]] = ...) -> None: ...

class PeerStats(_message.Message):
    __slots__ = ("node_id", "blocks_in", "bytes_in", "blocks_out", "bytes_out", "fetches", "failures", "checksum_failures", "fetch_ms", "recent_fetch_ms")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_OUT_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    FETCHES_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    FETCH_MS_FIELD_NUMBER: _ClassVar[int]
    RECENT_FETCH_MS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    blocks_in: int
    bytes_in: int
    blocks_out: int
    bytes_out: int
    fetches: int
    failures: int
    checksum_failures: int
    fetch_ms: float
    recent_fetch_ms: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, node_id: _Optional[str] = ..., blocks_in: _Optional[int] = ..., bytes_in: _Optional[int] = ..., blocks_out: _Optional[int] = ..., bytes_out: _Optional[int] = ..., fetches: _Optional[int] = ..., failures: _Optional[int] = ..., checksum_failures: _Optional[int] = ..., fetch_ms: _Optional[float] = ..., recent_fetch_ms: _Optional[_Iterable[float]] = ...) -> None: ...

class FetchBlocksRequest(_message.Message):
    __slots__ = ("client_id", "node_id", "namespace", "tokens", "start_block", "layout", "max_blocks", "key_size")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    START_BLOCK_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KEY_SIZE_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    node_id: str
    namespace: str
    tokens: bytes
    start_block: int
    layout: KVLayout
    max_blocks: int
    key_size: int
    def __init__(self, client_id: _Optional[str] = ..., node_id: _Optional[str] = ..., namespace: _Optional[str] = ..., tokens: _Optional[bytes] = ..., start_block: _Optional[int] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., max_blocks: _Optional[int] = ..., key_size: _Optional[int] = ...) -> None: ...

class FetchBlocksOffer(_message.Message):
    __slots__ = ("epoch", "first_block", "num_blocks", "data_port", "ticket")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    first_block: int
    num_blocks: int
    data_port: int
    ticket: bytes
    def __init__(self, epoch: _Optional[str] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., data_port: _Optional[int] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class DiskStats(_message.Message):
    __slots__ = ("capacity_blocks", "blocks", "bytes", "slot_bytes", "hit_tokens", "promoted_blocks", "demoted_blocks", "evicted_blocks", "verify_failures", "pending_writes", "loaded_blocks", "dropped_at_load", "generation", "state", "last_error", "write_errors")
    CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMOTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEMOTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FAILURES_FIELD_NUMBER: _ClassVar[int]
    PENDING_WRITES_FIELD_NUMBER: _ClassVar[int]
    LOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_AT_LOAD_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    WRITE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    capacity_blocks: int
    blocks: int
    bytes: int
    slot_bytes: int
    hit_tokens: int
    promoted_blocks: int
    demoted_blocks: int
    evicted_blocks: int
    verify_failures: int
    pending_writes: int
    loaded_blocks: int
    dropped_at_load: int
    generation: int
    state: str
    last_error: str
    write_errors: int
    def __init__(self, capacity_blocks: _Optional[int] = ..., blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., promoted_blocks: _Optional[int] = ..., demoted_blocks: _Optional[int] = ..., evicted_blocks: _Optional[int] = ..., verify_failures: _Optional[int] = ..., pending_writes: _Optional[int] = ..., loaded_blocks: _Optional[int] = ..., dropped_at_load: _Optional[int] = ..., generation: _Optional[int] = ..., state: _Optional[str] = ..., last_error: _Optional[str] = ..., write_errors: _Optional[int] = ...) -> None: ...

class DumpTreeRequest(_message.Message):
    __slots__ = ("namespace", "max_depth", "page_size", "cursor")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    max_depth: int
    page_size: int
    cursor: bytes
    def __init__(self, namespace: _Optional[str] = ..., max_depth: _Optional[int] = ..., page_size: _Optional[int] = ..., cursor: _Optional[bytes] = ...) -> None: ...

class TreeNode(_message.Message):
    __slots__ = ("node_id", "parent_id", "depth_tokens", "tokens", "block_ids", "lock_count", "hits", "last_access", "window_ids", "block_hashes", "keys")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    DEPTH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LOCK_COUNT_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    LAST_ACCESS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    node_id: int
    parent_id: int
    depth_tokens: int
    tokens: bytes
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    lock_count: int
    hits: int
    last_access: float
    window_ids: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    keys: bytes
    def __init__(self, node_id: _Optional[int] = ..., parent_id: _Optional[int] = ..., depth_tokens: _Optional[int] = ..., tokens: _Optional[bytes] = ..., block_ids: _Optional[_Iterable[int]] = ..., lock_count: _Optional[int] = ..., hits: _Optional[int] = ..., last_access: _Optional[float] = ..., window_ids: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[_Iterable[int]] = ..., keys: _Optional[bytes] = ...) -> None: ...

class DumpTreeResponse(_message.Message):
    __slots__ = ("namespace", "last_sequence", "nodes", "next_cursor", "key_size")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    NEXT_CURSOR_FIELD_NUMBER: _ClassVar[int]
    KEY_SIZE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    last_sequence: int
    nodes: _containers.RepeatedCompositeFieldContainer[TreeNode]
    next_cursor: bytes
    key_size: int
    def __init__(self, namespace: _Optional[str] = ..., last_sequence: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[TreeNode, _Mapping]]] = ..., next_cursor: _Optional[bytes] = ..., key_size: _Optional[int] = ...) -> None: ...

class ClearRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    def __init__(self, namespace: _Optional[str] = ...) -> None: ...

class ClearResponse(_message.Message):
    __slots__ = ("num_freed",)
    NUM_FREED_FIELD_NUMBER: _ClassVar[int]
    num_freed: int
    def __init__(self, num_freed: _Optional[int] = ...) -> None: ...

class EventsRequest(_message.Message):
    __slots__ = ("from_sequence", "namespace", "epoch")
    FROM_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    from_sequence: int
    namespace: str
    epoch: str
    def __init__(self, from_sequence: _Optional[int] = ..., namespace: _Optional[str] = ..., epoch: _Optional[str] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_ids", "parent_block_id", "tokens", "block_hashes", "parent_block_hash", "keys", "key_size")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KEY_SIZE_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    parent_block_id: int
    tokens: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    parent_block_hash: int
    keys: bytes
    key_size: int
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., parent_block_id: _Optional[int] = ..., tokens: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[int]] = ..., parent_block_hash: _Optional[int] = ..., keys: _Optional[bytes] = ..., key_size: _Optional[int] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_ids", "block_hashes", "tier")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    tier: str
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[_Iterable[int]] = ..., tier: _Optional[str] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WindowStored(_message.Message):
    __slots__ = ("block_ids", "block_hashes", "window_ids")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    WINDOW_IDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    window_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[_Iterable[int]] = ..., window_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class WindowRemoved(_message.Message):
    __slots__ = ("block_ids", "block_hashes", "window_ids")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    WINDOW_IDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    window_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[_Iterable[int]] = ..., window_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("sequence", "namespace", "timestamp", "epoch", "stored", "removed", "cleared", "lagged", "window_stored", "window_removed")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    LAGGED_FIELD_NUMBER: _ClassVar[int]
    WINDOW_STORED_FIELD_NUMBER: _ClassVar[int]
    WINDOW_REMOVED_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    namespace: str
    timestamp: float
    epoch: str
    stored: BlockStored
    removed: BlockRemoved
    cleared: AllBlocksCleared
    lagged: bool
    window_stored: WindowStored
    window_removed: WindowRemoved
    def __init__(self, sequence: _Optional[int] = ..., namespace: _Optional[str] = ..., timestamp: _Optional[float] = ..., epoch: _Optional[str] = ..., stored: _Optional[_Union[BlockStored, _Mapping]] = ..., removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ..., lagged: _Optional[bool] = ..., window_stored: _Optional[_Union[WindowStored, _Mapping]] = ..., window_removed: _Optional[_Union[WindowRemoved, _Mapping]] = ...) -> None: ...
