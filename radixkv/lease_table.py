"""The service's leases: who holds what, until when.

A lease belongs to one client (`owner`) and one namespace; it holds tree pins (`handles`) and
blocks allocated to it and not yet inserted (`owned`). The table opens, finds, renews and ends
leases and counts them per owner; what ending a lease does to the trees and the pool is the
service's (the `release` it is built with). A lease not used for its TTL expires: the sweeper
ends it (`expire`), or the next call naming it does; the last EXPIRED_MEMORY expired ids are
remembered, to tell "expired" from "unknown".
"""

from __future__ import annotations

import itertools
import secrets
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from radixkv.errors import (
    AlreadyExists,
    IntegrityError,
    InvalidArgument,
    LeaseExpired,
    LimitExceeded,
    NotFound,
    PermissionDenied,
)
from radixkv.index.hints import NO_HINT
from radixkv.service_config import ServiceConfig

EXPIRED_MEMORY = 65536  # how many expired lease ids we remember, to tell "expired" from "unknown"


@dataclass(slots=True)
class Lease:
    lease_id: int
    owner: str
    namespace: str
    expires_at: float
    ttl_s: float
    handles: list[object] = field(default_factory=list)  # tree lock handles
    owned: dict[int, None] = field(default_factory=dict)  # leased block ids, in order


class LeaseTable:
    """Live leases by id, counted per owner, and the claims of ids an Insert names.
    `release(lease, hint)` undoes what a lease holds (pins, blocks) and returns the blocks it
    freed; the table calls it when a lease ends."""

    def __init__(self, clock: Callable[[], float], config: ServiceConfig,
                 is_free: Callable[[int], bool], release: Callable[[Lease, int], int]) -> None:
        self._clock = clock
        self._default_ttl_s = config.lease_ttl_s  # for the message of an expired lease
        self._max_per_owner = config.max_leases_per_client
        self._is_free = is_free  # the pool's: is this block id free?
        self._release = release
        self._leases: dict[int, Lease] = {}
        self._of_owner: dict[str, int] = {}
        self._expired: OrderedDict[int, None] = OrderedDict()
        self.num_expired = 0  # leases that ran past their TTL, since start
        # Lease ids: a random start per service life, so ids from an earlier start are unknown.
        self._ids = itertools.count(secrets.randbits(62) + 1)

    def __len__(self) -> int:
        return len(self._leases)

    def __iter__(self) -> Iterator[Lease]:
        return iter(self._leases.values())

    def check_room(self, owner: str, new_leases: int) -> None:
        """LimitExceeded unless `owner` may open `new_leases` more leases."""
        held = self._of_owner.get(owner, 0)
        if held + new_leases > self._max_per_owner:
            raise LimitExceeded(f"client {owner!r} holds {held} live leases and asked for "
                                f"{new_leases} more; limit {self._max_per_owner} "
                                "per client (release leases when done)")

    def open(self, owner: str, namespace: str, ttl_s: float) -> Lease:
        lease = Lease(next(self._ids), owner, namespace, self._clock() + ttl_s, ttl_s)
        self._leases[lease.lease_id] = lease
        self._of_owner[owner] = self._of_owner.get(owner, 0) + 1
        return lease

    def get(self, owner: str, lease_id: int) -> Lease:
        """The live lease `lease_id` of `owner` (not renewed: callers `touch` it once their
        checks passed). One past its TTL ends here; LeaseExpired, NotFound or
        PermissionDenied otherwise."""
        lease = self._leases.get(lease_id)
        if lease is not None and lease.expires_at <= self._clock():
            self.end(lease, expired=True)
            lease = None
        if lease is None:
            if lease_id in self._expired:
                raise LeaseExpired(f"lease {lease_id} expired (ttl {self._default_ttl_s:g} s);"
                                   " its pins and blocks were released")
            raise NotFound(f"unknown lease {lease_id}")
        if lease.owner != owner:
            raise PermissionDenied(f"lease {lease_id} belongs to another client")
        return lease

    @staticmethod
    def check_namespace(lease: Lease, namespace: str) -> None:
        """PermissionDenied unless the lease is of `namespace`."""
        if namespace != lease.namespace:
            raise PermissionDenied(f"lease {lease.lease_id} belongs to namespace "
                                   f"{lease.namespace!r}, not {namespace!r}")

    def find(self, lease_id: int) -> Lease:
        """A lease the caller got from `get` or `open` under the same lock."""
        return self._leases[lease_id]

    def touch(self, lease: Lease) -> None:
        lease.expires_at = self._clock() + lease.ttl_s

    def claim(self, lease: Lease, b: int, claimed: set[int], what: str) -> None:
        """Claim id `b` (a "block" or "window part") for an insert: the lease's own, not yet
        claimed by another item; else the precise error (O(live leases): the error path)."""
        if b in claimed:
            raise InvalidArgument(f"{what} {b} is claimed by two items of one insert")
        if b in lease.owned:
            claimed.add(b)
            return
        if any(b in other.owned for other in self._leases.values()):
            raise PermissionDenied(f"{what} {b} is leased to another lease, not {lease.lease_id}")
        if self._is_free(b):
            raise PermissionDenied(f"{what} {b} is not allocated to lease {lease.lease_id}")
        raise AlreadyExists(f"{what} {b} is already cached "
                            + ("under another prefix" if what == "block" else "at another block"))

    def leased_blocks(self) -> int:
        """Blocks allocated to leases and not yet inserted or freed (for stats and messages:
        O(live leases))."""
        return sum(len(lease.owned) for lease in self._leases.values())

    def end(self, lease: Lease, expired: bool = False, hint: int = NO_HINT) -> int:
        """End a lease: its pins and blocks go (the table's `release`); returns blocks freed."""
        freed = self._release(lease, hint)
        del self._leases[lease.lease_id]
        left = self._of_owner[lease.owner] - 1
        if left:
            self._of_owner[lease.owner] = left
        else:
            del self._of_owner[lease.owner]
        if expired:
            self.num_expired += 1
            self._expired[lease.lease_id] = None
            if len(self._expired) > EXPIRED_MEMORY:
                self._expired.popitem(last=False)
        return freed

    def expire(self) -> int:
        """End every lease past its TTL. Returns how many ended."""
        now = self._clock()
        stale = [lease for lease in self._leases.values() if lease.expires_at <= now]
        for lease in stale:
            self.end(lease, expired=True)
        return len(stale)

    def check_integrity(self) -> tuple[int, Counter[str]]:
        """No block leased twice and the per-owner counts right; returns the leased blocks and
        the live leases per namespace (IntegrityError otherwise)."""
        owners = Counter(b for lease in self._leases.values() for b in lease.owned)
        if owners and max(owners.values()) > 1:
            b = owners.most_common(1)[0][0]
            raise IntegrityError(f"block {b} is leased to {owners[b]} leases")
        by_owner = Counter(lease.owner for lease in self._leases.values())
        if by_owner != Counter(self._of_owner):
            raise IntegrityError("per-client or per-namespace lease counts are off")
        # each leased block counted once (checked just above)
        return owners.total(), Counter(lease.namespace for lease in self._leases.values())
