from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RouteRequest(_message.Message):
    __slots__ = ("namespace", "tokens", "exclude", "probe")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    tokens: bytes
    exclude: _containers.RepeatedScalarFieldContainer[str]
    probe: bool
    def __init__(self, namespace: _Optional[str] = ..., tokens: _Optional[bytes] = ..., exclude: _Optional[_Iterable[str]] = ..., probe: _Optional[bool] = ...) -> None: ...

class MemberRoute(_message.Message):
    __slots__ = ("node_id", "address", "epoch", "cached_tokens", "cost", "load")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    epoch: str
    cached_tokens: int
    cost: float
    load: float
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., epoch: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., cost: _Optional[float] = ..., load: _Optional[float] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("members", "block_size", "namespace_known")
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_KNOWN_FIELD_NUMBER: _ClassVar[int]
    members: _containers.RepeatedCompositeFieldContainer[MemberRoute]
    block_size: int
    namespace_known: bool
    def __init__(self, members: _Optional[_Iterable[_Union[MemberRoute, _Mapping]]] = ..., block_size: _Optional[int] = ..., namespace_known: _Optional[bool] = ...) -> None: ...

class MembersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MemberStatus(_message.Message):
    __slots__ = ("node_id", "address", "epoch", "state", "error", "block_size", "num_blocks", "indexed_blocks", "namespaces", "events_applied", "resyncs", "routed", "live_leases", "requests", "query_tokens", "hit_tokens", "registered_s")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    INDEXED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    EVENTS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    RESYNCS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_FIELD_NUMBER: _ClassVar[int]
    LIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_S_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    epoch: str
    state: str
    error: str
    block_size: int
    num_blocks: int
    indexed_blocks: int
    namespaces: int
    events_applied: int
    resyncs: int
    routed: int
    live_leases: int
    requests: int
    query_tokens: int
    hit_tokens: int
    registered_s: float
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., epoch: _Optional[str] = ..., state: _Optional[str] = ..., error: _Optional[str] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., indexed_blocks: _Optional[int] = ..., namespaces: _Optional[int] = ..., events_applied: _Optional[int] = ..., resyncs: _Optional[int] = ..., routed: _Optional[int] = ..., live_leases: _Optional[int] = ..., requests: _Optional[int] = ..., query_tokens: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., registered_s: _Optional[float] = ...) -> None: ...

class MembersResponse(_message.Message):
    __slots__ = ("members", "etcd", "prefix", "routes", "uptime_s")
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    ETCD_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    members: _containers.RepeatedCompositeFieldContainer[MemberStatus]
    etcd: str
    prefix: str
    routes: int
    uptime_s: float
    def __init__(self, members: _Optional[_Iterable[_Union[MemberStatus, _Mapping]]] = ..., etcd: _Optional[str] = ..., prefix: _Optional[str] = ..., routes: _Optional[int] = ..., uptime_s: _Optional[float] = ...) -> None: ...
