"""Server configuration: one frozen ServerConfig; the RADIXKV_* variables it reads are listed
and read in radixkv.protocol.env."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from kvpool.layout import KVLayout
from radixkv.protocol.env import default_socket_path, server_settings
from radixkv.rpc.auth import read_token
from radixkv.rpc.etcd import NO_SECURITY, EtcdSecurity
from radixkv.service.config import ServiceConfig


@dataclass(frozen=True, slots=True)
class ServerConfig:
    layout: KVLayout = field(default_factory=lambda: KVLayout.from_preset("llama-3.2-1b"))
    num_blocks: int = 1024  # a sliding-window layout: its full parts
    sink_fraction: float = 0.125  # quantized layouts with sink tokens: share of sink blocks
    # sliding-window layouts: the window parts beside num_blocks full parts (None: as many), or
    # the share of the pool's bytes they take (kvpool.base.create_pool)
    num_window_blocks: int | None = None
    window_fraction: float | None = None
    backend: str = "host"
    device: int = 0
    socket: str | None = None  # None: default_socket_path(); "" with tcp set: TCP only
    tcp: str | None = None  # "HOST:PORT" to also listen on TCP
    max_message_bytes: int = 64 << 20
    workers: int = 2  # threads running calls (radixkv/rpc/executor.py says why so few)
    stream_workers: int = 16  # concurrent server streams (Events subscribers, ...); more refused
    streams_per_peer: int | None = None  # server streams one TCP peer may hold (None: half)
    # calls and streams in progress or queued at once; past it RESOURCE_EXHAUSTED at once
    max_concurrent_rpcs: int = 256
    metrics_port: int | None = None
    tls_cert: str | None = None  # PEM files: TLS on the TCP port
    tls_key: str | None = None
    auth_token: str | None = None  # required from every call (but health Check) when set
    insecure: bool = False  # allow TCP without a token (logged loudly)
    cluster: str | None = None  # etcd://HOST:PORT[/CLUSTER]: register as a member there
    node_id: str | None = None  # this member's id in the cluster (required with cluster)
    advertise: str | None = None  # the address members publish (default: the first bound)
    cluster_ttl_s: int = 5  # the etcd lease of the registration: a crashed member expires
    engine_url: str = ""  # the engine server beside this member, advertised for the gateway
    etcd_security: EtcdSecurity = NO_SECURITY  # TLS and auth toward etcd
    # the disk tier below the pool (radixkv/disk/): its directory, size in blocks (None: as
    # many as disk_capacity_bytes hold), and the blocks one Match may promote
    disk_dir: str | None = None
    disk_capacity_blocks: int | None = None
    disk_capacity_bytes: int | None = None
    disk_promote_blocks: int = 1 << 20
    lookup_table: bool = True  # publish the lookup table engines read (radixkv/table/)
    service: ServiceConfig = field(default_factory=ServiceConfig)

    @classmethod
    def from_env(cls, **overrides: Any) -> ServerConfig:
        """Defaults <- RADIXKV_* environment <- explicit overrides (None means unset)."""
        env = server_settings()
        ttl = env.pop("lease_ttl_s", None)
        if "auth_token" in env:
            env["auth_token"] = read_token(None, env["auth_token"])
        cfg = replace(cls(), **env)
        if ttl is not None:
            cfg = replace(cfg, service=replace(cfg.service, lease_ttl_s=ttl))
        return replace(cfg, **{k: v for k, v in overrides.items() if v is not None})

    @property
    def socket_path(self) -> str | None:
        if self.socket == "" and self.tcp:
            return None
        return self.socket or default_socket_path()

