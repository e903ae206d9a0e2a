"""How the SGLang backend's leases end: Releases and Inserts sent unwaited (releaser.Releaser),
Releases waited for, and when a get's copy surely ran under its lease's pins.

A lease's pins end only by its Release (this backend's), by its TTL (radixkv's CLOCK_MONOTONIC,
the one this process reads: the same machine), or with radixkv's process: a Clear is refused
while a lease pins anything, eviction takes unpinned blocks only, and disk-tier promotions fill
free blocks. So on a host pool (a shared-memory file of the serving process, never reused) a
copy that ended before (Match sent + TTL granted - `release_margin_s`, 0.1 s by default), with
that process still alive after it, read pinned bytes: the get answers at once and its Release
goes out unwaited (a failure is counted, `release_failures`). Otherwise (a CUDA pool, a copy
past that time, a pool whose owner is gone or unknown) the Release is waited for and its answer
decides. Stale held leases, and those of exists and sets whose answer is already known, are
released unwaited too.

Why a set may answer True before its Insert is confirmed: SGLang (0.5.23, cache_controller's
_page_backup and unified_radix_cache's _drain_backup) uses a True only to go on to the call's
next batch, to drop its host lock on the node (its host slots may then be freed and reused,
which is safe: the copy out of them has ended, and on a CUDA pool it is synchronized first) and
to count backed-up tokens. It never takes a True as a promise that a later batch_exists or get
will find the pages: those ask radixkv, which may evict any unpinned block at any moment. An
Insert that fails after the answer (its lease expired, radixkv restarted, died or refused it)
is thus, for SGLang, an eviction right after a successful Insert: the pages are not found and
are recomputed. No wrong bytes can be served: blocks become matchable only through the Insert,
which is sent after the copy ended, and radixkv refuses the Insert of a lease that ended (a
copy that outlived its lease inserts nothing). A failure is counted (`set_insert_failed_pages`)
and logged once per kind. docs/sglang.md has the whole argument.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from kvpool.handle import pid_alive
from radixkv.client import Client
from radixkv.integrations.releaser import Releaser
from radixkv.protocol.errors import LeaseExpired, NotFound, PermissionDenied
from radixkv.protocol.values import LeaseMatch

log = logging.getLogger("radixkv.integrations.sglang")


class LeaseEnds:
    """Ends the backend's leases; counts into `stats` (the backend's counters)."""

    def __init__(self, stats: dict[str, int], margin_s: float) -> None:
        self.stats = stats
        self.margin_s = margin_s
        self.releaser = Releaser(self._release_failed, "radixkv-sglang-release")
        self._insert_errors_logged: set[str] = set()

    def pins_held(self, sent: float, ttl: float, mapping: Any) -> bool:
        """Whether a copy that ends now ran under the pins of a lease of `ttl` s whose Match was
        sent at `sent`: within its TTL, on a host pool whose owner is alive after it."""
        return (ttl > 0 and time.monotonic() < sent + ttl - self.margin_s
                and _owner_alive(mapping))

    def release(self, client: Client, leases: list[LeaseMatch]) -> None:
        """End leases whose Release answer changes nothing here, without waiting for it: those
        of the pool radixkv serves now (the others ended with their pool, and their ids mean
        nothing to the new one). A failure is only counted: the TTL ends such a lease."""
        ids = [m.lease_id for m in leases if m.epoch == client.epoch]
        if ids:
            self.releaser.release(client, ids)

    @staticmethod
    def release_waited(client: Client, leases: list[LeaseMatch]) -> None:
        """`release`, waiting for the answer (one that already ended is fine)."""
        ids = [m.lease_id for m in leases if m.epoch == client.epoch]
        if ids:
            try:
                client.release(*ids)
            except (LeaseExpired, NotFound, PermissionDenied):
                pass

    def insert(self, client: Client, namespace: str, path: list[bytes], m: LeaseMatch,
               blocks: Sequence[int], pages: int) -> None:
        """Queue the Insert (ending `m`) of `pages` pages copied into their blocks; the set has
        answered True already. A failure (the lease expired, radixkv restarted or refused) is
        counted and logged once per kind: those pages are then simply not cached, as if evicted
        right after an Insert, and nothing was made matchable."""

        def send() -> None:
            client.insert_keys(namespace, path, blocks, m.lease_id, epoch=m.epoch,
                               release=True)
            self.stats["set_stored_pages"] += pages

        def failed(e: BaseException) -> None:
            self.stats["set_insert_failed_pages"] += pages
            kind = type(e).__name__
            if kind not in self._insert_errors_logged:
                self._insert_errors_logged.add(kind)
                log.warning("radixkv: an unwaited Insert of backed-up pages failed (%s: %s); "
                            "those pages are not cached (logged once per kind of failure)",
                            kind, e)

        self.releaser.insert(send, failed)

    def _release_failed(self, e: BaseException, leases: int) -> None:
        self.stats["release_failures"] += leases
        log.info("radixkv: an unwaited release failed (%s: %s); its lease ends by its TTL",
                 type(e).__name__, e)


def _owner_alive(mapping: Any) -> bool:
    """Whether `mapping` is of a host pool whose owner (the serving process) is alive; False
    for any other pool (CUDA: copies are asynchronous and the memory is the owner's)."""
    if getattr(mapping, "backend", None) != "host":
        return False
    pid = getattr(mapping.handle, "owner_pid", 0)
    return bool(pid) and pid_alive(pid)
