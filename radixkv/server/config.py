"""Server configuration: one frozen ServerConfig, and the one place RADIXKV_* variables are read.

| variable              | meaning                                   | default                     |
| --------------------- | ----------------------------------------- | --------------------------- |
| RADIXKV_SOCKET        | Unix socket path (server and clients)     | see default_socket_path()   |
| RADIXKV_NUM_BLOCKS    | pool size in blocks                       | 1024                        |
| RADIXKV_BACKEND       | host or cuda                              | host                        |
| RADIXKV_TCP           | also listen on HOST:PORT                  | off                         |
| RADIXKV_LEASE_TTL     | seconds a lease lives without use         | 30                          |
| RADIXKV_AUTH_TOKEN    | bearer token (server requires, client sends) | off                      |
| RADIXKV_TLS_CA        | client: PEM of the CA that signed the server's TLS certificate | off  |
"""

from __future__ import annotations

import os
import stat
import tempfile
from dataclasses import dataclass, field, replace
from typing import Any

from gpu_pool.layout import KVLayout
from radixkv.errors import PermissionDenied
from radixkv.server.auth import read_token
from radixkv.service import ServiceConfig


def default_socket_path() -> str:
    """$RADIXKV_SOCKET, else $XDG_RUNTIME_DIR/radixkv.sock, else /tmp/radixkv-$UID/radixkv.sock."""
    if os.environ.get("RADIXKV_SOCKET"):
        return os.environ["RADIXKV_SOCKET"]
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "radixkv.sock")
    return os.path.join(tempfile.gettempdir(), f"radixkv-{os.getuid()}", "radixkv.sock")


def check_socket_dir(socket_path: str) -> None:
    """Refuse (PermissionDenied) a socket whose directory another local user could have made or
    could write: it must be a real directory owned by this user and not writable by group or
    others, or a root-owned sticky one like /tmp; a socket file there must be this user's.
    Otherwise that user could pre-create it and impersonate the service (tmux and ssh-agent
    check the same)."""
    directory = os.path.dirname(os.path.abspath(socket_path))
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return  # the server creates it 0700
    uid = os.getuid()
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionDenied(f"socket directory {directory} is not a directory (a symlink?)")
    shared_sticky = st.st_uid == 0 and st.st_mode & stat.S_ISVTX
    if not shared_sticky and (st.st_uid != uid or st.st_mode & 0o022):
        raise PermissionDenied(
            f"socket directory {directory} is owned by uid {st.st_uid} with mode "
            f"{stat.S_IMODE(st.st_mode):o}: it must be yours (uid {uid}) and not writable by "
            "group or others; remove it or choose another --socket / $RADIXKV_SOCKET")
    try:
        sock = os.lstat(socket_path)
    except FileNotFoundError:
        return
    if sock.st_uid != uid:
        raise PermissionDenied(f"socket {socket_path} belongs to uid {sock.st_uid}, not you "
                               f"(uid {uid}): refusing a service another user may run")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    layout: KVLayout = field(default_factory=lambda: KVLayout.from_preset("llama-3.2-1b"))
    num_blocks: int = 1024  # a sliding-window layout: its full parts
    sink_fraction: float = 0.125  # quantized layouts with sink tokens: share of sink blocks
    # sliding-window layouts: the window parts beside num_blocks full parts (None: as many), or
    # the share of the pool's bytes they take (gpu_pool.base.create_pool)
    num_window_blocks: int | None = None
    window_fraction: float | None = None
    backend: str = "host"
    device: int = 0
    socket: str | None = None  # None: default_socket_path(); "" with tcp set: TCP only
    tcp: str | None = None  # "HOST:PORT" to also listen on TCP
    max_message_bytes: int = 64 << 20
    workers: int = 2  # threads running calls (radixkv/server/executor.py says why so few)
    stream_workers: int = 16  # concurrent server streams (Events subscribers, ...)
    metrics_port: int | None = None
    tls_cert: str | None = None  # PEM files: TLS on the TCP port
    tls_key: str | None = None
    auth_token: str | None = None  # required from every radixkv.v1 call when set
    cluster: str | None = None  # etcd://HOST:PORT[/CLUSTER]: register as a member there
    node_id: str | None = None  # this member's id in the cluster (required with cluster)
    advertise: str | None = None  # the address members publish (default: the first bound)
    cluster_ttl_s: int = 5  # the etcd lease of the registration: a crashed member expires
    service: ServiceConfig = field(default_factory=ServiceConfig)

    @classmethod
    def from_env(cls, **overrides: Any) -> ServerConfig:
        """Defaults <- RADIXKV_* environment <- explicit overrides (None means unset)."""
        env = os.environ
        cfg = cls()
        if "RADIXKV_NUM_BLOCKS" in env:
            cfg = replace(cfg, num_blocks=int(env["RADIXKV_NUM_BLOCKS"]))
        if "RADIXKV_BACKEND" in env:
            cfg = replace(cfg, backend=env["RADIXKV_BACKEND"])
        if "RADIXKV_TCP" in env:
            cfg = replace(cfg, tcp=env["RADIXKV_TCP"])
        if env.get("RADIXKV_AUTH_TOKEN"):
            cfg = replace(cfg, auth_token=read_token(None, env["RADIXKV_AUTH_TOKEN"]))
        if "RADIXKV_LEASE_TTL" in env:
            cfg = replace(cfg, service=replace(cfg.service,
                                               lease_ttl_s=float(env["RADIXKV_LEASE_TTL"])))
        return replace(cfg, **{k: v for k, v in overrides.items() if v is not None})

    @property
    def socket_path(self) -> str | None:
        if self.socket == "" and self.tcp:
            return None
        return self.socket or default_socket_path()


def client_token() -> str | None:
    """The bearer token a client sends: $RADIXKV_AUTH_TOKEN, or None."""
    return os.environ.get("RADIXKV_AUTH_TOKEN") or None


def client_tls_ca() -> str | None:
    """PEM file of the CA a client trusts for TLS: $RADIXKV_TLS_CA, or None (plaintext)."""
    return os.environ.get("RADIXKV_TLS_CA") or None

