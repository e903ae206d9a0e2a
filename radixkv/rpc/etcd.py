"""A small synchronous etcd v3 client over gRPC: the calls membership and the router need.

It speaks etcd's own v3 gRPC API through stubs generated from proto/radixkv/etcd/ (a subset of
etcd's messages, wire-compatible) with the project's pinned grpcio-tools, so it shares the
project's grpcio and protobuf and needs no other package. EtcdSecurity adds TLS (a CA, and a
client certificate if etcd asks for one) and etcd's user/password auth (Authenticate, then the
token etcd returns on every call; renewed when etcd says it expired).

    etcd = Etcd.connect("etcd://127.0.0.1:2379")
    lease = etcd.grant(5)                 # seconds
    etcd.put(b"/k", b"v", lease)
    etcd.keep_alive(lease)                # > 0: renewed; 0: the lease is gone
    kvs, revision = etcd.get_prefix(b"/")
    for events in etcd.watch_prefix(b"/", revision + 1): ...
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc

from radixkv.etcd import kv_pb2, rpc_pb2, rpc_pb2_grpc
from radixkv.protocol.errors import InvalidArgument, Unavailable

DEFAULT_CLUSTER = "default"


@dataclass(frozen=True, slots=True)
class EtcdTarget:
    """Where etcd is and which cluster (a key prefix) inside it: `etcd://HOST:PORT[/NAME]`."""

    host: str
    port: int
    cluster: str = DEFAULT_CLUSTER

    @classmethod
    def parse(cls, url: str) -> EtcdTarget:
        if "://" not in url:
            url = "etcd://" + url
        parts = urlsplit(url)
        if parts.scheme not in ("etcd", "http") or not parts.hostname or not parts.port:
            raise InvalidArgument(f"etcd address {url!r}: expected etcd://HOST:PORT[/CLUSTER]")
        cluster = parts.path.strip("/") or DEFAULT_CLUSTER
        if not all(c.isalnum() or c in "-_." for c in cluster):
            raise InvalidArgument(f"cluster name {cluster!r}: letters, digits, - _ . only")
        return cls(parts.hostname, parts.port, cluster)

    @property
    def grpc_target(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def members_prefix(self) -> bytes:
        """The key prefix under which the cluster's members register."""
        return f"/radixkv/{self.cluster}/members/".encode()

    def __str__(self) -> str:
        return f"etcd://{self.host}:{self.port}/{self.cluster}"


@dataclass(frozen=True, slots=True)
class EtcdSecurity:
    """How to reach a guarded etcd: TLS trusting `ca` (PEM; a client certificate `cert`/`key`
    for etcd's --client-cert-auth), and/or etcd auth as `user` with `password`."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = None

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise InvalidArgument("an etcd client certificate needs both --etcd-cert and "
                                  "--etcd-key")
        if self.user and self.password is None:
            raise InvalidArgument("--etcd-user needs a password (--etcd-password-file or "
                                  "$RADIXKV_ETCD_PASSWORD)")

    @property
    def tls(self) -> bool:
        return bool(self.ca or self.cert)

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: str | None) -> bytes | None:
            if not path:
                return None
            try:
                return Path(path).read_bytes()
            except OSError as e:
                raise InvalidArgument(f"cannot read {path}: {e}") from None

        return grpc.ssl_channel_credentials(root_certificates=read(self.ca),
                                            private_key=read(self.key),
                                            certificate_chain=read(self.cert))


NO_SECURITY = EtcdSecurity()


def prefix_end(prefix: bytes) -> bytes:
    """The range end that makes [prefix, end) every key starting with `prefix`."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


@dataclass(frozen=True, slots=True)
class WatchEvent:
    key: bytes
    value: bytes  # b"" for a delete
    deleted: bool
    revision: int


class Etcd:
    """One channel to one etcd endpoint. Thread-safe. Errors become Unavailable (etcd down or
    unreachable) with the endpoint named."""

    def __init__(self, target: EtcdTarget, timeout: float = 5.0,
                 security: EtcdSecurity = NO_SECURITY) -> None:
        self.target = target
        self.timeout = timeout
        self.security = security
        if security.tls:
            self._channel = grpc.secure_channel(target.grpc_target, security.credentials())
        else:
            self._channel = grpc.insecure_channel(target.grpc_target)
        self._kv = rpc_pb2_grpc.KVStub(self._channel)  # type: ignore[no-untyped-call]
        self._lease = rpc_pb2_grpc.LeaseStub(self._channel)  # type: ignore[no-untyped-call]
        self._watch = rpc_pb2_grpc.WatchStub(self._channel)  # type: ignore[no-untyped-call]
        self._auth = rpc_pb2_grpc.AuthStub(self._channel)  # type: ignore[no-untyped-call]
        self._token_lock = threading.Lock()
        self._metadata: tuple[tuple[str, str], ...] = ()

    @classmethod
    def connect(cls, url: str, timeout: float = 5.0,
                security: EtcdSecurity = NO_SECURITY) -> Etcd:
        return cls(EtcdTarget.parse(url), timeout, security)

    def close(self) -> None:
        self._channel.close()

    def _error(self, e: grpc.RpcError) -> Unavailable:
        return Unavailable(f"etcd at {self.target.grpc_target}: {e.code().name}: {e.details()}")

    def _authenticate(self, renew: bool = False) -> tuple[tuple[str, str], ...]:
        """The metadata that carries etcd's auth token (none without a user); `renew`: ask
        for a new one (the old one expired)."""
        if not self.security.user:
            return ()
        with self._token_lock:
            if renew or not self._metadata:
                try:
                    r = self._auth.Authenticate(rpc_pb2.AuthenticateRequest(
                        name=self.security.user, password=self.security.password or ""),
                        timeout=self.timeout)
                except grpc.RpcError as e:
                    raise self._error(e) from None
                self._metadata = (("token", str(r.token)),)
            return self._metadata

    def _call(self, method: Any, request: Any) -> Any:
        metadata = self._authenticate()
        try:
            return method(request, timeout=self.timeout, metadata=metadata)
        except grpc.RpcError as e:
            if not (metadata and e.code() == grpc.StatusCode.UNAUTHENTICATED):
                raise self._error(e) from None
        try:  # etcd's token expired (or etcd restarted): authenticate again, once
            return method(request, timeout=self.timeout, metadata=self._authenticate(True))
        except grpc.RpcError as e:
            raise self._error(e) from None

    def grant(self, ttl_s: int) -> int:
        """A new lease of `ttl_s` seconds; returns its id."""
        r = self._call(self._lease.LeaseGrant, rpc_pb2.LeaseGrantRequest(TTL=ttl_s))
        if r.error:
            raise Unavailable(f"etcd refused a {ttl_s} s lease: {r.error}")
        return int(r.ID)

    def revoke(self, lease: int) -> None:
        """End a lease now: etcd deletes every key attached to it."""
        self._call(self._lease.LeaseRevoke, rpc_pb2.LeaseRevokeRequest(ID=lease))

    def keep_alive(self, lease: int) -> int:
        """Renew a lease once; returns the TTL granted, 0 if the lease no longer exists."""
        call = self._lease.LeaseKeepAlive(iter([rpc_pb2.LeaseKeepAliveRequest(ID=lease)]),
                                          timeout=self.timeout, metadata=self._authenticate())
        try:
            for r in call:
                return max(0, int(r.TTL))
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                self._authenticate(True)  # the next renewal carries a fresh token
            raise self._error(e) from None
        finally:
            call.cancel()
        return 0

    def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        """Returns the store's revision after the put."""
        r = self._call(self._kv.Put, rpc_pb2.PutRequest(key=key, value=value, lease=lease))
        return int(r.header.revision)

    def get(self, key: bytes) -> bytes | None:
        r = self._call(self._kv.Range, rpc_pb2.RangeRequest(key=key))
        return bytes(r.kvs[0].value) if r.kvs else None

    def get_prefix(self, prefix: bytes) -> tuple[list[tuple[bytes, bytes]], int]:
        """Every (key, value) under `prefix`, and the store's revision they are read at."""
        r = self._call(self._kv.Range, rpc_pb2.RangeRequest(key=prefix,
                                                            range_end=prefix_end(prefix)))
        return [(bytes(kv.key), bytes(kv.value)) for kv in r.kvs], int(r.header.revision)

    def create(self, key: bytes, value: bytes, lease: int = 0,
               replacing: int = 0) -> tuple[bool, bytes | None]:
        """Put `key` only if it does not exist (or, with `replacing`, only if it still has that
        mod revision): one transaction. Returns (True, None) if written, else (False, the value
        there now, None if it vanished meanwhile)."""
        compare = (rpc_pb2.Compare(key=key, target=rpc_pb2.Compare.MOD,
                                   result=rpc_pb2.Compare.EQUAL, mod_revision=replacing)
                   if replacing else
                   rpc_pb2.Compare(key=key, target=rpc_pb2.Compare.CREATE,
                                   result=rpc_pb2.Compare.EQUAL, create_revision=0))
        r = self._call(self._kv.Txn, rpc_pb2.TxnRequest(
            compare=[compare],
            success=[rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=key, value=value,
                                                                      lease=lease))],
            failure=[rpc_pb2.RequestOp(request_range=rpc_pb2.RangeRequest(key=key))]))
        if r.succeeded:
            return True, None
        kvs = r.responses[0].response_range.kvs if r.responses else []
        return False, bytes(kvs[0].value) if kvs else None

    def get_revision(self, key: bytes) -> tuple[bytes, int] | None:
        """The value of `key` and its mod revision, or None."""
        r = self._call(self._kv.Range, rpc_pb2.RangeRequest(key=key))
        return (bytes(r.kvs[0].value), int(r.kvs[0].mod_revision)) if r.kvs else None

    def delete(self, key: bytes) -> int:
        r = self._call(self._kv.DeleteRange, rpc_pb2.DeleteRangeRequest(key=key))
        return int(r.deleted)

    def watch_prefix(self, prefix: bytes, start_revision: int,
                     stop: threading.Event) -> Iterator[list[WatchEvent]]:
        """Batches of changes under `prefix` from `start_revision` on, until `stop` is set
        (checked at least every second: etcd sends progress notifications) or the stream
        breaks (Unavailable; the caller re-reads with get_prefix and watches again)."""
        requests: queue.Queue[rpc_pb2.WatchRequest | None] = queue.Queue()
        requests.put(rpc_pb2.WatchRequest(create_request=rpc_pb2.WatchCreateRequest(
            key=prefix, range_end=prefix_end(prefix), start_revision=start_revision,
            progress_notify=True)))

        def send() -> Iterator[rpc_pb2.WatchRequest]:
            while (item := requests.get()) is not None:
                yield item

        call = self._watch.Watch(send(), metadata=self._authenticate())
        done = threading.Event()

        def wake() -> None:  # a blocked read ends when the caller stops
            while not done.is_set():
                if stop.wait(0.5):
                    call.cancel()
                    return

        threading.Thread(target=wake, name="etcd-watch-waker", daemon=True).start()
        try:
            for r in call:
                if r.canceled:
                    raise Unavailable(f"etcd cancelled the watch: {r.cancel_reason or 'compacted'}"
                                      f" (compact revision {r.compact_revision})")
                if r.events:
                    yield [WatchEvent(bytes(e.kv.key), bytes(e.kv.value),
                                      e.type == kv_pb2.Event.DELETE, int(e.kv.mod_revision))
                           for e in r.events]
        except grpc.RpcError as e:
            if stop.is_set():
                return
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                self._authenticate(True)
            raise Unavailable(f"etcd watch at {self.target.grpc_target}: {e.code().name}: "
                              f"{e.details()}") from None
        finally:
            done.set()
            requests.put(None)
            call.cancel()
