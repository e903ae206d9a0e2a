"""radixkv as SGLang's HiCache storage backend (the "L3" tier behind host memory).

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-mem-layout page_first --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "radixkv",
            "module_path": "radixkv.integrations.sglang", "class_name": "RadixKVStore",
            "interface_v1": 1, "hicache_storage_pass_prefix_keys": true,
            "socket": "/run/radixkv.sock"}'

SGLang names a page of KV by a chain hash (64 hex digits: SHA-256 of the page's tokens and the
hash before it), never by tokens, so pages live in a key-keyed radixkv namespace
(radixkv.service.keyed): one key per radixkv block, block_size = SGLang's page size. With
`hicache_storage_pass_prefix_keys` each call also gets the keys from the sequence start, so a
call's pages extend the tree path of their prefix wherever SGLang cut its batches; without it a
call's keys stand alone (a path from the root).

- `batch_exists`: the leading run of keys cached, read from radixkv's lookup table in shared
  memory (radixkv/table/): no call. The `batch_get_v1` that follows pins what it loads with its
  own Match, so a page evicted in between is simply not loaded. With `"lookup": "match"` in
  the extra config, where radixkv publishes no table, or where its member fetches from peers
  and the table lacks part of the run, a Match answers instead and its lease, which pins that
  run, is held for the get (radixkv.integrations.held; `exists_hold_s`, 0: released at once).
- `batch_get_v1`: under the exists' lease (else a fresh Match), the cached run's blocks are
  copied from radixkv's mapped pool into SGLang's host pool slots, then the lease is released:
  one Match and one Release per prefetched batch, the Release not waited for where the copy is
  known to have run under the pins (ends.py). A key past a gap is never loaded.
- `batch_set_v1`: Match, which also allocates blocks for the uncached pages, copy the host pages
  into them, answer, and the Insert (which ends the lease) goes out unwaited after the copy
  (ends.py): one waited call. Pages already cached are not copied again; no room (every block
  pinned) fails the uncached pages only.

Within one backend, reads see its writes: batch_exists, the gets, clear, close and counters
first wait for the Inserts queued so far (no wait when none is), and a set whose prefix is not
found while Inserts are queued waits for them and matches again.

Copies go between SGLang's host pool (`page_first` or `page_first_direct`) and radixkv's
canonical [layers, 2, block, heads, dim] blocks (layout.HostPages; the host slots checked by
slots.py). The namespace names the model, TP/PP/DP rank and size, dtype and page size
(`namespace` in the extra config replaces the model part; keys.py). `register_mem_pool_host`
refuses a host pool whose geometry differs from radixkv's pool, naming both.

Failures never leave here as exceptions and never as wrong bytes: a radixkv that is down or
restarting (link.Link) makes batch_exists 0 and the get/set calls False (SGLang recomputes or
skips the backup); a copy counts only if its lease's pins held until the copy ended (ends.py:
when a Release or an Insert need not be waited for; docs/sglang.md has the whole argument).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from radixkv.client import Client
from radixkv.integrations.held import HeldLeases
from radixkv.integrations.layout import TORCH_DTYPES, HostPages, LayoutError
from radixkv.integrations.link import Down, LayoutMismatch, Link, check_pool_layout
from radixkv.integrations.sglang.ends import LeaseEnds
from radixkv.integrations.sglang.flat import FlatPages
from radixkv.integrations.sglang.host_slots import HostSlots
from radixkv.integrations.sglang.keys import KeyPaths, namespace_name
from radixkv.protocol.errors import LeaseExpired, NotFound, PermissionDenied, Unavailable
from radixkv.protocol.limits import MIN_LEASE_TTL_S
from radixkv.protocol.values import LeaseMatch
from radixkv.table.reader import Peek

log = logging.getLogger("radixkv.integrations.sglang")

T = TypeVar("T")


class RadixKVStore(FlatPages, HiCacheStorage):  # type: ignore[misc]
    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self.config = storage_config
        self.extra = extra
        self.target: str | None = extra.get("socket") or os.environ.get("RADIXKV_SOCKET")
        self.namespace = ""
        self.pages: HostPages | None = None
        self.slots: HostSlots | None = None
        self.mem_pool_host: Any = None
        self.stats = {"exists_calls": 0, "exists_hit_pages": 0, "get_pages": 0,
                      "get_failed_pages": 0, "set_pages": 0, "set_stored_pages": 0,
                      "set_failed_pages": 0, "unavailable": 0, "get_held_leases": 0,
                      "get_leases_lost": 0, "get_releases_nowait": 0,
                      "get_releases_waited": 0, "release_failures": 0,
                      "set_insert_failed_pages": 0, "bad_slot_pages": 0, "exists_table": 0}
        self.use_table = str(extra.get("lookup", "table")) != "match"
        self.peer_fetch = False  # radixkv's member fetches from peers (its PoolInfo says)
        self._default_ttl: dict[str, float] = {}  # pool epoch -> the TTL a Match of 0 gets
        self.keys = KeyPaths()
        self.hold_s = float(extra.get("exists_hold_s", 5.0))  # within radixkv's TTL cap
        self.held = HeldLeases(self.hold_s)
        self.ends = LeaseEnds(self.stats, float(extra.get("release_margin_s", 0.1)))
        self.releaser = self.ends.releaser
        # per batch since the last get_stats, as SGLang's storage metrics take them
        self._metrics: dict[str, list[float]] = {"prefetch_pgs": [], "backup_pgs": [],
                                                 "prefetch_bandwidth": [],
                                                 "backup_bandwidth": []}
        self.link = Link(
            self.target, f"sglang-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}",
            check=self._check, timeout=float(extra.get("timeout", 5.0)),
            retry_s=float(extra.get("retry_s", 1.0)), what="SGLang HiCache", logger=log)

    # ---- set-up ------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take SGLang's host KV pool: its layout must be one HostPages maps and its geometry
        radixkv's pool's (LayoutMismatch naming both otherwise)."""
        super().register_mem_pool_host(mem_pool_host)
        host = mem_pool_host
        try:
            self.pages = HostPages(host.layout, host.page_size)
        except LayoutError as e:
            raise LayoutMismatch(str(e)) from None
        self.slots = HostSlots(host, direct=self.pages.layout == "page_first_direct")
        if getattr(host, "kv_buffer", None) is None or getattr(host, "v_head_dim",
                                                                host.head_dim) != host.head_dim:
            raise LayoutMismatch(f"SGLang host pool {type(host).__name__} is not an MHA pool "
                                 "with equal K and V head sizes; radixkv stores MHA KV")
        dtype = TORCH_DTYPES.get(host.dtype)
        if dtype is None:
            raise LayoutMismatch(f"SGLang's KV dtype {host.dtype} has no radixkv pool dtype")
        self.want = (host.layer_num, host.head_num, host.head_dim, dtype, host.page_size)
        self.namespace = namespace_name(self.config, self.extra, dtype, host.page_size)
        if self.link.start():  # LayoutMismatch (a refusal) propagates: SGLang does not start
            log.info("radixkv HiCache backend at %s: namespace %s",
                     self.target or "the default socket", self.namespace)

    def _check(self, client: Client) -> None:
        dtype, page = self.want[3], self.want[4]
        check_pool_layout(client, self.want, "SGLang's host KV pool", "page_size",
                          f"--dtype {dtype} --block-size {page} and this model's config")
        info = client.pool_info()
        self._default_ttl = {info.epoch: info.lease_ttl_s}
        self.peer_fetch = info.peer_fetch
        if self.hold_s > 0:  # a TTL radixkv grants: within [min(1 s, its default), its cap]
            low = min(MIN_LEASE_TTL_S, info.lease_ttl_s)
            self.held.hold_s = min(max(self.hold_s, low), info.max_lease_ttl_s)

    # ---- the v1 zero-copy interface ----------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of `keys`, from the first, radixkv holds (0 while it is down)."""
        self.stats["exists_calls"] += 1
        self.releaser.wait_inserts()  # read this backend's writes
        path, skip = self.keys.path(keys, extra_info)
        if path is None:
            return 0

        def run(client: Client) -> int:
            peek = self._peek(client, path)
            if peek is not None:
                return max(0, peek.num_blocks - skip)
            ttl = self.held.hold_s
            sent = time.monotonic()
            m = self._match(client, path, ttl=ttl)
            hits = max(0, len(m.block_ids) - skip)
            if hits and ttl > 0:  # pinned for the get that follows
                self.ends.release(client, self.held.hold(path, skip, m, sent, ttl))
            else:
                self.ends.release(client, [m])
            return hits

        hits = self._call(run, 0)
        self.stats["exists_hit_pages"] += hits
        return hits

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        """Load the leading run of `keys` into the host slots (page_size per key)."""
        self.stats["get_pages"] += len(keys)
        self.releaser.wait_inserts()
        path, skip = self.keys.path(keys, extra_info)
        out = [False] * len(keys)
        if path is None or self.pages is None:
            return out
        starts = self._page_starts(host_indices, len(keys))
        if not len(starts):
            return out
        path = path[:skip + len(starts)]  # a page past SGLang's host pool, and those after it

        def run(client: Client) -> int:
            held, stale = self.held.take(path, skip)
            self.ends.release(client, stale)
            if held is not None and held.match.epoch != client.epoch:
                held = None  # radixkv restarted since the exists: that lease went with its pool
            if held is None:
                sent = time.monotonic()
                m = self._match(client, path)
                ttl = self._default_ttl.get(m.epoch, 0.0)
            else:
                m, sent, ttl = held.match, held.at, held.ttl
                self.stats["get_held_leases"] += 1
            blocks = m.block_ids[skip:len(path)]
            try:
                mapping = client.pool_of(m.epoch)
                assert self.pages is not None
                self.pages.copy(self.mem_pool_host.kv_buffer, starts[:len(blocks)],
                                mapping.view(), blocks, to_pool=False)
            except BaseException:
                with contextlib.suppress(Exception):
                    client.release(m.lease_id)
                raise
            if self.ends.pins_held(sent, ttl, mapping):
                # the copy ended within the lease's TTL, its pool's process alive after it:
                # the pins held through it, whatever the Release answers
                self.stats["get_releases_nowait"] += 1
                self.ends.release(client, [m])
                return len(blocks)
            self.stats["get_releases_waited"] += 1
            try:  # the pins held through the copy only if the lease is still valid now
                client.release(m.lease_id)
            except (LeaseExpired, NotFound, PermissionDenied) as e:
                self.stats["get_leases_lost"] += 1
                log.warning("radixkv: a prefetch's lease ended before its copy did (%s): "
                            "its %d pages are not loaded", e, len(keys))
                return 0
            return len(blocks)

        start = time.perf_counter()
        hits = self._call(run, 0)
        self._record("prefetch", hits, time.perf_counter() - start)
        self.stats["get_failed_pages"] += len(keys) - hits
        return [True] * hits + out[hits:]

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        """Store the host pages of `keys` (already cached ones are not copied again)."""
        self.stats["set_pages"] += len(keys)
        path, skip = self.keys.path(keys, extra_info)
        if path is None or self.pages is None:
            return [False] * len(keys)
        starts = self._page_starts(host_indices, len(keys))
        stored = len(starts)  # a page past SGLang's host pool, and those after it: False
        if not stored:
            self.stats["set_failed_pages"] += len(keys)
            return [False] * len(keys)
        path = path[:skip + stored]

        def run(client: Client) -> list[bool]:
            m = self._match(client, path, store=True)
            if len(m.block_ids) < skip and self.releaser.inserting:
                # the prefix may be in an Insert still queued (the batch before this one)
                self.ends.release(client, [m])
                self.releaser.wait_inserts()
                m = self._match(client, path, store=True)
            have, ids = len(m.block_ids), m.new_block_ids
            if have < skip or m.alloc_error or not ids:
                # the prefix is gone (nothing to hang these pages on), no room (the pages
                # cached already count), or every page is cached
                self.ends.release(client, [m])
                cached = max(0, have - skip)
                return [True] * cached + [False] * (stored - cached)
            assert self.pages is not None
            view = client.pool_of(m.epoch).view()
            self.pages.copy(self.mem_pool_host.kv_buffer, starts[have - skip:], view, ids,
                            to_pool=True)
            if view.is_cuda:  # the host slots are SGLang's again once we answer
                torch.cuda.synchronize(view.device)
            self.ends.insert(client, self.namespace, path, m, m.block_ids + ids, len(ids))
            return [True] * stored

        start = time.perf_counter()
        done = self._call(run, [False] * stored) + [False] * (len(keys) - stored)
        self._record("backup", done.count(True), time.perf_counter() - start)
        self.stats["set_failed_pages"] += done.count(False)
        return done

    # ---- the rest ----------------------------------------------------------------------------

    def clear(self) -> None:
        """Drop this namespace's pages from radixkv (refused there while any is in use; the
        leases this backend holds for prefetches are released first)."""

        self.releaser.flush()  # the Clear is refused while any lease pins a block

        def run(client: Client) -> int:
            self.ends.release_waited(client, self.held.drain())  # before the Clear, which
            return client.clear(self.namespace)  # is refused while they pin anything

        self._call(run, 0)

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics (pages and GB/s per batch since the last call), as its
        --enable-cache-report storage metrics read them; `counters` has radixkv's own."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        metrics = StorageMetrics()
        for name, values in self._metrics.items():
            getattr(metrics, name).extend(values)
            values.clear()
        return metrics

    def counters(self) -> dict[str, int]:
        """Pages asked, stored, loaded and failed, calls while radixkv was unusable, link
        failures: since start (after the queued Inserts were answered)."""
        self.releaser.wait_inserts()  # so that the set counters are those of its answers
        return {**self.stats, "link_failures": self.link.failures,
                "release_calls": self.releaser.sent, "insert_calls": self.releaser.inserts}

    def close(self) -> None:
        self.releaser.wait_inserts()
        ids = self.held.drain()
        if ids:
            self._call(lambda c: self.ends.release_waited(c, ids), None)  # before closing
        self.releaser.close()
        self.link.close()

    # ---- internals ---------------------------------------------------------------------------

    def _match(self, client: Client, path: list[bytes], store: bool = False,
               ttl: float = 0.0) -> LeaseMatch:
        """Match `path` in the namespace (a lease of `ttl` s; 0: radixkv's default). If radixkv
        restarted since its layout was checked, the new pool's layout is checked first
        (`Link.check_answer`: LayoutMismatch if it no longer fits, the link then refuses; Down
        if radixkv restarted again meanwhile; either after releasing)."""
        m = client.match_keys(self.namespace, path, ttl=ttl, store=store)
        self.link.check_answer(client, m.epoch, lambda: client.release(m.lease_id))
        return m

    def _peek(self, client: Client, path: list[bytes]) -> Peek | None:
        """The table's answer for `path`; None where a Match must answer (no table, `lookup:
        match`, or a member that may fetch the rest from its peers). A pool epoch new to the
        link has its layout checked first."""
        if not self.use_table:
            return None
        try:
            peek = client.peek_keys(self.namespace, path)
        except Unavailable:
            return None
        if self.peer_fetch and peek.num_blocks < len(path):
            return None
        self.link.check_answer(client, peek.epoch)
        self.stats["exists_table"] += 1
        return peek

    def _record(self, what: str, pages: int, seconds: float) -> None:
        if pages and self.pages is not None:
            page_bytes = self.mem_pool_host.get_size_per_token() * self.pages.page_size
            self._metrics[f"{what}_pgs"].append(pages)
            self._metrics[f"{what}_bandwidth"].append(pages * page_bytes / seconds / 1e9)

    def _page_starts(self, host_indices: torch.Tensor, pages: int) -> torch.Tensor:
        """slots.HostSlots.page_starts; the pages left out are counted."""
        assert self.slots is not None
        starts = self.slots.page_starts(host_indices, pages)
        self.stats["bad_slot_pages"] += pages - len(starts)
        return starts

    def _call(self, fn: Callable[[Client], T], failed: T) -> T:
        """`fn` through the link; `failed` when radixkv is unusable or the call fails."""
        try:
            return self.link.call(fn)
        except Down:
            self.stats["unavailable"] += 1
            return failed
        except Exception as e:  # noqa: BLE001 - never raise into SGLang's I/O threads
            log.error("radixkv: %s: %s", type(e).__name__, e)
            return failed

