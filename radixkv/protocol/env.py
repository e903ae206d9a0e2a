"""The one place RADIXKV_* variables are read, and the socket check both sides make.

| variable              | meaning                                   | default                     |
| --------------------- | ----------------------------------------- | --------------------------- |
| RADIXKV_SOCKET        | Unix socket path (server and clients)     | see default_socket_path()   |
| RADIXKV_NUM_BLOCKS    | pool size in blocks                       | 1024                        |
| RADIXKV_BACKEND       | host or cuda                              | host                        |
| RADIXKV_TCP           | also listen on HOST:PORT                  | off                         |
| RADIXKV_LEASE_TTL     | seconds a lease lives without use         | 30                          |
| RADIXKV_AUTH_TOKEN    | bearer token (server requires, client sends) | off                      |
| RADIXKV_TLS_CA        | client: PEM of the CA that signed the server's TLS certificate | off  |
| RADIXKV_ETCD_CA       | members, routers: TLS to etcd, trusting this CA | off                   |
| RADIXKV_ETCD_USER     | members, routers: etcd auth user          | off                         |
| RADIXKV_ETCD_PASSWORD | members, routers: that user's password    | off                         |

The server's figures come through `server_settings()` into `ServerConfig.from_env`; a client reads
the socket, token and CA. Nothing here imports the server or the service.
"""

from __future__ import annotations

import os
import stat
import tempfile
from typing import Any

from radixkv.protocol.errors import PermissionDenied


def default_socket_path() -> str:
    """$RADIXKV_SOCKET, else $XDG_RUNTIME_DIR/radixkv.sock, else /tmp/radixkv-$UID/radixkv.sock."""
    if os.environ.get("RADIXKV_SOCKET"):
        return os.environ["RADIXKV_SOCKET"]
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "radixkv.sock")
    return os.path.join(tempfile.gettempdir(), f"radixkv-{os.getuid()}", "radixkv.sock")


def normalize_target(target: str | None) -> str:
    """None -> the default Unix socket; '/path' -> 'unix:///path'; others as given."""
    if target is None:
        target = default_socket_path()
    if target.startswith("/"):
        return f"unix://{target}"
    return target


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


def client_token() -> str | None:
    """The bearer token a client sends: $RADIXKV_AUTH_TOKEN, or None."""
    return os.environ.get("RADIXKV_AUTH_TOKEN") or None


def client_tls_ca() -> str | None:
    """PEM file of the CA a client trusts for TLS: $RADIXKV_TLS_CA, or None (plaintext)."""
    return os.environ.get("RADIXKV_TLS_CA") or None


def etcd_settings() -> dict[str, str]:
    """The RADIXKV_ETCD_* variables that are set, by EtcdSecurity field name."""
    names = {"ca": "RADIXKV_ETCD_CA", "user": "RADIXKV_ETCD_USER",
             "password": "RADIXKV_ETCD_PASSWORD"}
    return {field: os.environ[var] for field, var in names.items() if os.environ.get(var)}


def server_settings() -> dict[str, Any]:
    """The server's RADIXKV_* variables that are set, by ServerConfig field name (the auth
    token raw: the server checks it; the lease TTL under `lease_ttl_s`, a ServiceConfig field)."""
    env = os.environ
    out: dict[str, Any] = {}
    if "RADIXKV_NUM_BLOCKS" in env:
        out["num_blocks"] = int(env["RADIXKV_NUM_BLOCKS"])
    if "RADIXKV_BACKEND" in env:
        out["backend"] = env["RADIXKV_BACKEND"]
    if "RADIXKV_TCP" in env:
        out["tcp"] = env["RADIXKV_TCP"]
    if env.get("RADIXKV_AUTH_TOKEN"):
        out["auth_token"] = env["RADIXKV_AUTH_TOKEN"]
    if "RADIXKV_LEASE_TTL" in env:
        out["lease_ttl_s"] = float(env["RADIXKV_LEASE_TTL"])
    return out
