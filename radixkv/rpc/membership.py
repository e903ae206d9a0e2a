"""A member's registration in etcd: `radixkv serve --cluster etcd://HOST:PORT --node-id ID`.

The member puts one key, `/radixkv/<cluster>/members/<node id>`, whose value (JSON, MemberInfo)
says where engines reach it, its pool epoch, layout and capacity; the key is attached to an etcd
lease of `--cluster-ttl` seconds that a thread renews every third of it. A clean stop revokes
the lease (etcd deletes the key at once); a crashed member stops renewing, so etcd deletes the
key when the TTL runs out and routers drop it. If etcd restarts and has lost the lease (a fresh
data directory), the next renewal finds it gone and the member registers again.

The key is created in a transaction that succeeds only if nobody holds it: a second live server
with the same node id is refused (AlreadyExists naming the holder). A record that names an
address this process has bound is a crashed earlier run of it, so it is taken over at once
rather than after its TTL (an `--advertise` address it did not bind is not proof: refused).

With a cluster token (the members' `--auth-token-file`), the record carries an HMAC-SHA256 of
its fields under that token: a router holding the token follows only records it can verify, so
whoever can write to etcd cannot point routers, and the token they send, at an address of their
choosing.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, replace

from radixkv.protocol.errors import AlreadyExists, InvalidArgument, RadixKVError
from radixkv.rpc.etcd import NO_SECURITY, Etcd, EtcdSecurity, EtcdTarget

log = logging.getLogger("radixkv.cluster")

DEFAULT_TTL_S = 5
SIGNING_CONTEXT = b"radixkv member record v1\n"


@dataclass(frozen=True, slots=True)
class MemberInfo:
    """What a member publishes about itself (the value of its key, as JSON)."""

    node_id: str
    address: str  # a gRPC target engines and routers can reach: unix:///path or HOST:PORT
    epoch: str  # its pool epoch: changes on every start
    block_size: int
    num_blocks: int
    bytes_per_block: int
    layout: str  # e.g. "16 layers x 8 kv heads x 64, bf16"
    pid: int
    started: float  # unix time
    ttl_s: int = DEFAULT_TTL_S  # its registration's lease: how long a crash goes unnoticed
    signature: str = ""  # hex HMAC-SHA256 of the other fields under the cluster token
    engine_url: str = ""  # the engine server beside it (`--engine-url`), for `radixkv gateway`

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> MemberInfo:
        optional = ("ttl_s", "signature", "engine_url")
        try:
            d = json.loads(data)
            info = cls(**{k: d[k] for k in cls.__dataclass_fields__
                          if k in d or k not in optional})
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidArgument(f"not a radixkv member record ({e}): {data[:120]!r}") from None
        if not isinstance(info.signature, str):
            raise InvalidArgument(f"not a radixkv member record (signature): {data[:120]!r}")
        return info

    def digest(self, token: str) -> str:
        fields = asdict(self)
        fields.pop("signature")
        if not fields["engine_url"]:  # records from before the field sign as they did
            fields.pop("engine_url")
        body = json.dumps(fields, sort_keys=True).encode()
        return hmac.new(token.encode(), SIGNING_CONTEXT + body, hashlib.sha256).hexdigest()

    def signed(self, token: str | None) -> MemberInfo:
        """This record signed with the cluster token (unsigned without one)."""
        return replace(self, signature=self.digest(token) if token else "")

    def verified(self, token: str) -> bool:
        """Signed with `token`, over exactly these fields."""
        return bool(self.signature) and hmac.compare_digest(self.signature, self.digest(token))


def check_node_id(node_id: str) -> str:
    if not node_id or len(node_id) > 128 or not all(c.isalnum() or c in "-_." for c in node_id):
        raise InvalidArgument(f"node id {node_id!r}: 1-128 letters, digits, - _ . only")
    return node_id


def member_key(target: EtcdTarget, node_id: str) -> bytes:
    return target.members_prefix + node_id.encode()


class Registration:
    """Keeps one member registered while it runs. `start()` registers (Unavailable if etcd
    cannot be reached); `stop()` deregisters. Renewal failures are logged and retried."""

    def __init__(self, target: EtcdTarget, info: MemberInfo, ttl_s: int = DEFAULT_TTL_S,
                 token: str | None = None, security: EtcdSecurity = NO_SECURITY,
                 bound: frozenset[str] = frozenset()) -> None:
        """`bound`: the addresses this process listens on: a record naming one of them is an
        earlier run of this member (it cannot be alive: we bound its address) and is taken
        over; any other holder of the node id is refused."""
        if ttl_s < 1:
            raise InvalidArgument(f"--cluster-ttl must be >= 1 s, got {ttl_s}")
        self.target = target
        self.info = info.signed(token)
        self.bound = bound
        self.ttl_s = ttl_s
        self.key = member_key(target, info.node_id)
        self.etcd = Etcd(target, timeout=max(1.0, ttl_s / 3), security=security)
        self.lease = 0
        self.registrations = 0  # how often it (re)registered
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="etcd-keepalive", daemon=True)

    def start(self) -> None:
        """Register, or AlreadyExists if another live server holds this node id."""
        self._register()
        self._thread.start()

    def _register(self) -> None:
        lease = self.etcd.grant(self.ttl_s)
        try:
            self._claim(lease)
        except BaseException:
            try:
                self.etcd.revoke(lease)
            except RadixKVError:
                pass  # it expires by itself
            raise
        self.lease = lease
        self.registrations += 1
        log.info("registered %s as %s in %s (lease %x, TTL %d s)", self.info.address,
                 self.info.node_id, self.target, self.lease, self.ttl_s)

    def _claim(self, lease: int) -> None:
        value = self.info.to_json()
        for _ in range(5):  # the holder may change under us: read again
            done, held = self.etcd.create(self.key, value, lease)
            if done:
                return
            current = self.etcd.get_revision(self.key)
            if current is None:
                continue  # it expired meanwhile
            try:
                other = MemberInfo.from_json(current[0])
            except InvalidArgument:
                other = None
            if other is None or other.address != self.info.address \
                    or other.address not in self.bound:
                where = (f"{other.address} (pid {other.pid}, registered "
                         f"{time.strftime('%H:%M:%S', time.localtime(other.started))})"
                         if other else "an unreadable record")
                ttl = other.ttl_s if other else self.ttl_s
                raise AlreadyExists(
                    f"node id {self.info.node_id} is held by {where} in {self.target}: a "
                    "second server with the same node id is refused. Stop that one or "
                    f"choose another --node-id (if it crashed, its key expires within {ttl} s)")
            # an address this process bound: an earlier run of this member that crashed (we
            # hold its socket or port now); take the key over at once
            done, _ = self.etcd.create(self.key, value, lease, replacing=current[1])
            if done:
                log.info("took over node id %s from an earlier run at the same address (pid "
                         "%d)", self.info.node_id, other.pid)
                return
        raise AlreadyExists(f"node id {self.info.node_id}: the key kept changing under us")

    def _renew(self) -> None:
        period = self.ttl_s / 3
        while not self._stop.wait(period):
            try:
                if self.etcd.keep_alive(self.lease) <= 0 or self.etcd.get(self.key) is None:
                    log.warning("etcd lost this member's lease or key: registering again")
                    self._register()
            except AlreadyExists as e:
                log.error("cannot register again: %s", e)
            except RadixKVError as e:
                log.warning("cannot renew the cluster registration: %s", e)

    def stop(self) -> None:
        """Deregister now (revoke the lease: etcd deletes the key). Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        try:
            self.etcd.revoke(self.lease)
            log.info("deregistered %s from %s", self.info.node_id, self.target)
        except RadixKVError as e:
            log.warning("could not deregister (the key expires after %d s): %s", self.ttl_s, e)
        self.etcd.close()


def make_info(node_id: str, address: str, epoch: str, block_size: int, num_blocks: int,
              bytes_per_block: int, layout: str, ttl_s: int = DEFAULT_TTL_S) -> MemberInfo:
    return MemberInfo(check_node_id(node_id), address, epoch, block_size, num_blocks,
                      bytes_per_block, layout, os.getpid(), time.time(), ttl_s)
