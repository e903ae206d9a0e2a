"""Leases a HiCache backend's `batch_exists` keeps for the `batch_get_v1` that follows it.

SGLang asks `batch_exists(keys)` for a batch, then (on another thread, once the scheduler has
host slots for the hits) `batch_get_v1` of the leading run it found, with the same prefix keys.
The Match that answered the exists already pinned those blocks, so the get can copy under that
lease and release it: one Match and one Release per prefetched batch instead of two of each.

A held lease is taken by the first get whose key path (prefix + keys) is a prefix of the held
one's, with the same prefix, and is then released exactly once, by that get. The lease is asked
for `hold_s` seconds; a get takes it only in the first half of that (so the copy has the other
half), after which it is dropped here and released, and the get matches afresh. An exists whose
get never comes (SGLang revoked the prefetch) holds its pins until then. Each held lease keeps
when its Match was sent and the TTL it asked for: the get knows from them until when the pins
surely hold (radixkv.integrations.sglang).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from radixkv.protocol.values import LeaseMatch


@dataclass(frozen=True)
class Held:
    path: tuple[bytes, ...]  # prefix keys, then the exists' keys
    skip: int  # where the exists' keys start in `path`
    match: LeaseMatch
    at: float  # when the Match was sent (the lease's TTL runs from later)
    ttl: float  # the TTL the Match asked for (and radixkv granted)


class HeldLeases:
    """The held leases of one backend, for any thread; at most `limit` (the oldest go first)."""

    def __init__(self, hold_s: float, limit: int = 64,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.hold_s = hold_s
        self.limit = limit
        self.clock = clock
        self._held: list[Held] = []
        self._lock = threading.Lock()

    def hold(self, path: Sequence[bytes], skip: int, match: LeaseMatch, at: float,
             ttl: float) -> list[LeaseMatch]:
        """Keep `match` (the Match of `path` sent at `at`, for a lease of `ttl` s) for a get;
        returns the leases now to release (stale or past the limit)."""
        with self._lock:
            self._held.append(Held(tuple(path), skip, match, at, ttl))
            return self._stale()

    def take(self, path: Sequence[bytes],
             skip: int) -> tuple[Held | None, list[LeaseMatch]]:
        """The held lease covering `path` (the same prefix: `skip` keys), now the caller's to
        release, or None; and the leases now to release (stale)."""
        key = tuple(path)
        with self._lock:
            stale = self._stale()
            if skip >= len(key):
                return None, stale
            for i, h in enumerate(self._held):
                if (h.skip == skip and len(h.path) >= len(key) and h.path[skip] == key[skip]
                        and h.path[:len(key)] == key):
                    del self._held[i]
                    return h, stale
            return None, stale

    def drain(self) -> list[LeaseMatch]:
        """Every held lease (to release: closing, clearing)."""
        with self._lock:
            out = [h.match for h in self._held]
            self._held.clear()
            return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def _stale(self) -> list[LeaseMatch]:
        usable_after = self.clock() - self.hold_s / 2
        keep = [h for h in self._held if h.at > usable_after][-self.limit:]
        kept = {id(h) for h in keep}
        gone = [h.match for h in self._held if id(h) not in kept]
        self._held = keep
        return gone
