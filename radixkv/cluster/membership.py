"""A member's registration in etcd: `radixkv serve --cluster etcd://HOST:PORT --node-id ID`.

The member puts one key, `/radixkv/<cluster>/members/<node id>`, whose value (JSON, MemberInfo)
says where engines reach it, its pool epoch, layout and capacity; the key is attached to an etcd
lease of `--cluster-ttl` seconds that a thread renews every third of it. A clean stop revokes
the lease (etcd deletes the key at once); a crashed member stops renewing, so etcd deletes the
key when the TTL runs out and routers drop it. If etcd restarts and has lost the lease (a fresh
data directory), the next renewal finds it gone and the member registers again.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass

from radixkv.cluster.etcd import Etcd, EtcdTarget
from radixkv.errors import InvalidArgument, RadixKVError

log = logging.getLogger("radixkv.cluster")

DEFAULT_TTL_S = 5


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

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> MemberInfo:
        try:
            d = json.loads(data)
            return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d or k != "ttl_s"})
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidArgument(f"not a radixkv member record ({e}): {data[:120]!r}") from None


def check_node_id(node_id: str) -> str:
    if not node_id or len(node_id) > 128 or not all(c.isalnum() or c in "-_." for c in node_id):
        raise InvalidArgument(f"node id {node_id!r}: 1-128 letters, digits, - _ . only")
    return node_id


def member_key(target: EtcdTarget, node_id: str) -> bytes:
    return target.members_prefix + node_id.encode()


class Registration:
    """Keeps one member registered while it runs. `start()` registers (Unavailable if etcd
    cannot be reached); `stop()` deregisters. Renewal failures are logged and retried."""

    def __init__(self, target: EtcdTarget, info: MemberInfo, ttl_s: int = DEFAULT_TTL_S) -> None:
        if ttl_s < 1:
            raise InvalidArgument(f"--cluster-ttl must be >= 1 s, got {ttl_s}")
        self.target = target
        self.info = info
        self.ttl_s = ttl_s
        self.key = member_key(target, info.node_id)
        self.etcd = Etcd(target, timeout=max(1.0, ttl_s / 3))
        self.lease = 0
        self.registrations = 0  # how often it (re)registered
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="etcd-keepalive", daemon=True)

    def start(self) -> None:
        current = self.etcd.get(self.key)
        if current is not None:
            other = MemberInfo.from_json(current)
            if other.pid != self.info.pid and other.address != self.info.address:
                log.warning("node id %s was registered by %s (pid %d); taking it over",
                            self.info.node_id, other.address, other.pid)
        self._register()
        self._thread.start()

    def _register(self) -> None:
        self.lease = self.etcd.grant(self.ttl_s)
        self.etcd.put(self.key, self.info.to_json(), self.lease)
        self.registrations += 1
        log.info("registered %s as %s in %s (lease %x, TTL %d s)", self.info.address,
                 self.info.node_id, self.target, self.lease, self.ttl_s)

    def _renew(self) -> None:
        period = self.ttl_s / 3
        while not self._stop.wait(period):
            try:
                if self.etcd.keep_alive(self.lease) <= 0 or self.etcd.get(self.key) is None:
                    log.warning("etcd lost this member's lease or key: registering again")
                    self._register()
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
