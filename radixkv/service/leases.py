"""The service's leases: who holds what, until when.

A lease belongs to one client id (`owner`: the calls naming it must come with that id) and one
namespace; it holds tree pins (`handles`) and blocks allocated to it and not yet inserted
(`owned`). Its `client` is what the limits count it under: the connection it was opened on
where the transport tells connections apart (TCP), else the client id (the server's choice:
radixkv.server.servicer). The table opens, finds, renews and ends leases; it holds at most
`max_leases` in all, `max_leases_per_client` per client, and one client's leases span at most
`namespaces_per_client` namespaces. What ending a lease does to the trees and the pool is the
service's (the `release` it is built with). A lease not used for its TTL expires: the sweeper
ends it (`expire`), or the next call naming it does; the last EXPIRED_MEMORY expired ids are
remembered, to tell "expired" from "unknown".
"""

from __future__ import annotations

import itertools
import secrets
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field

from radixkv.protocol.errors import (
    AlreadyExists,
    IntegrityError,
    InvalidArgument,
    LeaseExpired,
    LimitExceeded,
    NotFound,
    PermissionDenied,
)
from radixkv.service.config import ServiceConfig

EXPIRED_MEMORY = 65536  # how many expired lease ids we remember, to tell "expired" from "unknown"


@dataclass(slots=True)
class Lease:
    lease_id: int
    owner: str
    namespace: str
    expires_at: float
    ttl_s: float
    client: str  # what the limits count it under, e.g. "client id 'x'", "connection ipv4:..."
    # tree lock handles by the end node of their path, one per path (kinds.py), in the
    # order they were pinned or last pinned again; paths known to be held by one of them
    handles: dict[object, object] = field(default_factory=dict)
    covered: set[object] = field(default_factory=set)
    owned: dict[int, None] = field(default_factory=dict)  # leased block ids, in order


class LeaseTable:
    """Live leases by id, counted per client (and per client and namespace), and the claims
    of ids an Insert names. It calls nothing back: what a lease holds (pins, blocks) the
    service undoes before `end` drops the record."""

    def __init__(self, clock: Callable[[], float], config: ServiceConfig) -> None:
        self._clock = clock
        self._default_ttl_s = config.lease_ttl_s  # for the message of an expired lease
        self._max = config.max_leases
        self._max_per_client = config.max_leases_per_client
        self._max_namespaces = config.max_namespaces
        self._namespaces_per_client = config.namespaces_per_client
        self._leases: dict[int, Lease] = {}
        self._of_client: dict[str, Counter[str]] = {}  # client -> namespace -> live leases
        self._expired: OrderedDict[int, None] = OrderedDict()
        self.num_expired = 0  # leases that ran past their TTL, since start
        # Lease ids: a random start per service life, so ids from an earlier start are unknown.
        self._ids = itertools.count(secrets.randbits(62) + 1)

    def __len__(self) -> int:
        return len(self._leases)

    def __iter__(self) -> Iterator[Lease]:
        return iter(self._leases.values())

    def check_room(self, client: str, new_leases: int, namespaces: Collection[str]) -> None:
        """LimitExceeded unless `client` may open `new_leases` more leases in `namespaces`."""
        if len(self._leases) + new_leases > self._max:
            raise LimitExceeded(f"{len(self._leases)} live leases and {new_leases} more asked "
                                f"for; limit {self._max} live leases in all (release leases "
                                "when done)")
        spaces = self._of_client.get(client, Counter())
        held = spaces.total()
        if held + new_leases > self._max_per_client:
            raise LimitExceeded(f"{client} holds {held} live leases and asked for "
                                f"{new_leases} more; limit {self._max_per_client} "
                                "per client (release leases when done)")
        new = set(namespaces).difference(spaces)
        if len(spaces) + len(new) > self._namespaces_per_client:
            raise LimitExceeded(f"{client} holds leases in {len(spaces)} namespaces "
                                f"and asked for {len(new)} more; limit "
                                f"{self._namespaces_per_client} namespaces per client (of "
                                f"{self._max_namespaces})")

    def open(self, owner: str, client: str, namespace: str, ttl_s: float) -> Lease:
        lease = Lease(next(self._ids), owner, namespace, self._clock() + ttl_s, ttl_s, client)
        self._leases[lease.lease_id] = lease
        self._of_client.setdefault(client, Counter())[namespace] += 1
        return lease

    def get(self, owner: str, lease_id: int) -> Lease:
        """The live lease `lease_id` of `owner` (not renewed: callers `touch` it once their
        checks passed; one past its TTL the caller ended first: `overdue`); LeaseExpired,
        NotFound or PermissionDenied otherwise."""
        lease = self._leases.get(lease_id)
        if lease is None:
            if lease_id in self._expired:
                raise LeaseExpired(f"lease {lease_id} expired (ttl {self._default_ttl_s:g} s);"
                                   " its pins and blocks were released")
            raise NotFound(f"unknown lease {lease_id}")
        if lease.owner != owner:
            raise PermissionDenied(f"lease {lease_id} belongs to another client")
        return lease

    def overdue(self, lease_id: int) -> Lease | None:
        """Lease `lease_id` if it is past its TTL and not yet ended (the caller ends it)."""
        lease = self._leases.get(lease_id)
        return lease if lease is not None and lease.expires_at <= self._clock() else None

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

    def claim(self, lease: Lease, b: int, claimed: set[int], what: str, free: bool) -> None:
        """Claim id `b` (a "block" or "window part") for an insert: the lease's own, not yet
        claimed by another item; else the precise error (O(live leases): the error path;
        `free`: the pool has `b` free)."""
        if b in claimed:
            raise InvalidArgument(f"{what} {b} is claimed by two items of one insert")
        if b in lease.owned:
            claimed.add(b)
            return
        if any(b in other.owned for other in self._leases.values()):
            raise PermissionDenied(f"{what} {b} is leased to another lease, not {lease.lease_id}")
        if free:
            raise PermissionDenied(f"{what} {b} is not allocated to lease {lease.lease_id}")
        raise AlreadyExists(f"{what} {b} is already cached "
                            + ("under another prefix" if what == "block" else "at another block"))

    def leased_blocks(self) -> int:
        """Blocks allocated to leases and not yet inserted or freed (for stats and messages:
        O(live leases))."""
        return sum(len(lease.owned) for lease in self._leases.values())

    def end(self, lease: Lease, expired: bool = False) -> None:
        """The lease's record goes (the caller first drops its pins and frees its blocks)."""
        del self._leases[lease.lease_id]
        spaces = self._of_client[lease.client]
        spaces[lease.namespace] -= 1
        if not spaces[lease.namespace]:
            del spaces[lease.namespace]
            if not spaces:
                del self._of_client[lease.client]
        if expired:
            self.num_expired += 1
            self._expired[lease.lease_id] = None
            if len(self._expired) > EXPIRED_MEMORY:
                self._expired.popitem(last=False)

    def stale(self) -> list[Lease]:
        """The leases past their TTL (the caller ends them)."""
        now = self._clock()
        return [lease for lease in self._leases.values() if lease.expires_at <= now]

    def check_integrity(self) -> tuple[int, Counter[str]]:
        """No block leased twice and the per-owner counts right; returns the leased blocks and
        the live leases per namespace (IntegrityError otherwise)."""
        owners = Counter(b for lease in self._leases.values() for b in lease.owned)
        if owners and max(owners.values()) > 1:
            b = owners.most_common(1)[0][0]
            raise IntegrityError(f"block {b} is leased to {owners[b]} leases")
        by_client = Counter((lease.client, lease.namespace) for lease in self._leases.values())
        if by_client != Counter({(c, ns): n for c, spaces in self._of_client.items()
                                 for ns, n in spaces.items()}):
            raise IntegrityError("per-client or per-namespace lease counts are off")
        # each leased block counted once (checked just above)
        return owners.total(), Counter(lease.namespace for lease in self._leases.values())
