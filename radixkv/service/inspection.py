"""What the service shows of itself, under its lock: Stats, the tree (whole, or in pages read
in slices so the lock is let go between them), the key size of a namespace, the integrity
check. A part of KVService (radixkv/service/service.py), which holds the state."""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable

from kvpool.base import BlockPool
from radixkv.index.pages import page
from radixkv.index.results import NodeView
from radixkv.protocol.errors import IntegrityError, InvalidArgument, NotFound
from radixkv.protocol.values import DumpPage, ServiceStats
from radixkv.service.events import EventLog
from radixkv.service.leases import LeaseTable
from radixkv.service.namespaces import Namespaces
from radixkv.service.tier import NoTier, SettlingLock

DUMP_PAGE = 1024  # nodes per DumpTree page by default
MAX_DUMP_PAGE = 65536  # the most one page may ask for
DUMP_SLICE = 64  # nodes of a page read per hold of the lock (bench/dump_pages.py)


class Inspection:
    """KVService's read-only calls (the service's state, as KVService.__init__ sets it)."""

    pool: BlockPool
    block_size: int
    events: EventLog
    _lock: SettlingLock
    _namespaces: Namespaces
    _leases: LeaseTable
    _tier: NoTier
    _recent: deque[tuple[int, int]]
    _clock: Callable[[], float]
    _started: float

    def stats(self) -> ServiceStats:
        with self._lock:
            spaces = tuple(ns.stats() for ns in sorted(self._namespaces, key=lambda n: n.name))
            life = self._namespaces.lifetime()  # namespaces dropped earlier still count
            pool = self.pool
            return ServiceStats(
                **dataclasses.asdict(life),
                backend=pool.backend, epoch=pool.epoch, layout=pool.layout,
                event_sequence=self.events.last_sequence,
                num_blocks=pool.num_full_blocks,
                free_blocks=pool.num_free,
                leased_blocks=self._leases.leased_blocks(),
                cached_blocks=sum(ns.tree.num_cached_blocks for ns in self._namespaces),
                pinned_blocks=sum(ns.tree.num_locked_blocks for ns in self._namespaces),
                live_leases=len(self._leases),
                expired_leases=self._leases.num_expired,
                recent_requests=len(self._recent),
                recent_query_tokens=sum(q for q, _ in self._recent),
                recent_hit_tokens=sum(h for _, h in self._recent),
                uptime_s=self._clock() - self._started,
                namespaces=spaces,
                window_blocks=pool.num_window_blocks,
                free_window_blocks=pool.num_free_window,
                cached_window_blocks=sum(ns.num_window_blocks for ns in self._namespaces),
                disk=self._tier.stats(),
            )

    def dump_tree(self, namespace: str, max_depth: int = 0) -> tuple[list[NodeView], int]:
        """A snapshot of one namespace's tree (DFS pre-order, at most `max_depth` edges deep
        when > 0) and the last event sequence number it reflects."""
        with self._lock:
            if namespace not in self._namespaces:
                raise NotFound(f"namespace {namespace!r} does not exist (known: "
                               f"{', '.join(self._namespaces.names()) or 'none'})")
            return self._namespaces[namespace].nodes(max_depth), self.events.last_sequence

    def dump_page(self, namespace: str, cursor: bytes = b"", page_size: int = DUMP_PAGE,
                  max_depth: int = 0) -> DumpPage:
        """Up to `page_size` nodes of the tree after `cursor` (b"": from the start; else a
        previous page's next_cursor), each with its blocks' chained hashes. The page is read
        in slices of DUMP_SLICE nodes, the lock let go between them, so a page, like pages,
        may come from different moments (index/pages.py); its sequence number is the first
        slice's. A namespace dropped after the first slice ends the page there."""
        if not 1 <= page_size <= MAX_DUMP_PAGE:
            raise InvalidArgument(f"page_size {page_size}: 1 to {MAX_DUMP_PAGE} nodes")
        out: list[NodeView] = []
        sequence = None
        while True:
            with self._lock:
                ns = self._namespaces.get(namespace)
                if ns is None:
                    if sequence is not None:  # dropped meanwhile: nothing after the cursor
                        return DumpPage(tuple(out), sequence, b"")
                    raise NotFound(f"namespace {namespace!r} does not exist (known: "
                                   f"{', '.join(self._namespaces.names()) or 'none'})")
                unit, what = ns.cursor_unit
                if len(cursor) % unit:
                    raise InvalidArgument(f"cursor of {len(cursor)} bytes is not a path of "
                                          f"whole {what}: pass a next_cursor back")
                if sequence is None:
                    sequence = self.events.last_sequence
                nodes, cursor = page(ns.tree.root, self.block_size, cursor,
                                     min(DUMP_SLICE, page_size - len(out)), max_depth,
                                     self.events.block_hashes(namespace))
                out += ns.shown(nodes)
            if not cursor or len(out) == page_size:
                return DumpPage(tuple(out), sequence, cursor)
            time.sleep(0)  # a call waiting for the lock gets it (and the GIL) before the next slice

    def key_size(self, namespace: str) -> int:
        """The key size of a key-keyed namespace; 0 for a token-keyed or unknown one."""
        with self._lock:
            ns = self._namespaces.get(namespace)
            return ns.key_size if ns is not None else 0

    def namespaces(self) -> list[str]:
        with self._lock:
            return self._namespaces.names()

    def check_integrity(self) -> None:
        """free + leased + cached == total, and each part's own invariants; IntegrityError
        naming the first that fails (real checks: they hold under `python -O` too)."""
        with self._lock:
            self.pool.check_integrity()
            for ns in self._namespaces:
                ns.tree.check_integrity()
            leased, by_ns = self._leases.check_integrity()
            cached = sum(ns.tree.num_cached_blocks + ns.num_window_blocks  # ids of one pool
                         for ns in self._namespaces)
            free = self.pool.num_free + self.pool.num_free_window
            reserved = self._tier.reserved_blocks  # being read into from the tier below
            total = free + leased + cached + reserved
            if total != self.pool.num_blocks:
                raise IntegrityError(
                    f"free {free} + leased {leased} + cached {cached} + reserved {reserved} "
                    f"= {total} != {self.pool.num_blocks} blocks")
            if any(by_ns[ns.name] != ns.num_leases for ns in self._namespaces):
                raise IntegrityError("per-client or per-namespace lease counts are off")
            if any(name not in self._namespaces for name in by_ns):
                raise IntegrityError("a live lease names a namespace that was dropped")
            self._tier.check_integrity(sum(ns.tree.num_cached_blocks for ns in self._namespaces))
