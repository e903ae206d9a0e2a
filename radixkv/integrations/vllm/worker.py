"""The worker side of the vLLM connector: copies between vLLM's paged KV and radixkv's pool.

Loads the scheduler read from radixkv's lookup table come unpinned: one Match for the step's
loads pins them first (`pin`), before the forward, off vLLM's scheduler thread; a block evicted
since the scheduler's read is a failed load (recomputed).

Loads start before the step's forward (`start_loads`, from `start_load_kv`): on CPU pages they
are copied layer by layer on a thread of their own (`loader`), each layer's attention
waiting for its own layer only (`wait_layer`); on GPU pages (or with `layerwise` off) they are
copied whole before the forward (`load`). Either way each lease is Released after its copy: a
lease that ended before (expired, or radixkv gone) means the blocks may have been reused, so the
pages are reported as failed loads in the same step (`finish_loads`, before `take_failed`) and
vLLM recomputes them (kv_load_failure_policy "recompute"). Saves run after the forward
(`wait_for_save`): renew the lease for COPY_TTL_S (its blocks stay ours for the whole copy),
copy, Insert with the lease's pool epoch and release; a lease that expired before (e.g. during
the step's forward, under a short `--lease-ttl`) or a restarted radixkv stores nothing.

On a CUDA pool the copies are device to device on the current stream, synchronized before the
lease is released or the blocks inserted.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Any

import torch

from radixkv.client import STORE_ALL, Client
from radixkv.integrations import pages_kernel
from radixkv.integrations.layout import FlashPages, LayoutError, Pages, ProbedPages, check_layers
from radixkv.integrations.link import Down, LayoutMismatch, Link
from radixkv.integrations.vllm.loader import LayerLoader, release_after_copy
from radixkv.integrations.vllm.messages import Load, Save
from radixkv.integrations.vllm.stats import Stats
from radixkv.protocol.errors import InvalidArgument, LeaseExpired, NotFound, StalePool
from radixkv.protocol.values import LeaseMatch

_LAYER = re.compile(r"\.(\d+)\.")
# A store renews its lease for this long before it writes into the lease's blocks: were the lease
# to expire mid-copy, its blocks could go to another writer while this copy still lands in them.
COPY_TTL_S = 30.0


def layer_order(names: Sequence[str]) -> list[str]:
    """Layer names in model order (by the first number in the name)."""
    def key(name: str) -> tuple[int, str]:
        m = _LAYER.search(name)
        return (int(m.group(1)) if m else -1, name)
    return sorted(names, key=key)


class WorkerSide:
    def __init__(self, link: Link, vllm_config: Any, num_kv_heads: int, head_dim: int,
                 block_size: int, stats: Stats, layerwise: bool = True,
                 load_cpus: str = "auto") -> None:
        self.link = link
        self.vllm_config = vllm_config
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.stats = stats
        self.names: list[str] = []
        self.layers: list[torch.Tensor] = []
        self._pages: Pages | None = None
        self.failed_pages: set[int] = set()
        self.sent: set[str] = set()
        self.layerwise = layerwise
        self.load_cpus = load_cpus
        self.loader: LayerLoader | None = None

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.names = layer_order(list(kv_caches))
        self.layers = [kv_caches[n] for n in self.names]
        if self.layers and not self.layers[0].is_cuda:
            pages_kernel.ops()  # the native page copy: built (once per machine) or loaded now,
            # at the engine's start, rather than in its first request's copy
            if self.layerwise:
                self.loader = LayerLoader(self.link, self.names, self.load_cpus)

    def pages(self) -> Pages:
        """The page layout, found once (CPU pages are probed through the first layer's own
        cache write, after vLLM has set its attention kernel up)."""
        if self._pages is None:
            kv = self.layers[0]
            if kv.dim() == 5 and kv.shape[0] == 2:
                pages: Pages = FlashPages()
            else:
                layer = self.vllm_config.compilation_config.static_forward_context[self.names[0]]

                def write(k: torch.Tensor, v: torch.Tensor, page: torch.Tensor,
                          slots: torch.Tensor) -> None:
                    layer.impl.do_kv_cache_update(layer, k, v, page, slots)

                pages = ProbedPages.probe(write, self.num_kv_heads, self.block_size,
                                          self.head_dim, kv.dtype)
            check_layers(self.layers, pages, self.num_kv_heads, self.block_size, self.head_dim)
            self._pages = pages
        return self._pages

    def _sync(self) -> None:
        if self.layers and self.layers[0].is_cuda:
            torch.cuda.current_stream(self.layers[0].device).synchronize()

    def pin(self, loads: Sequence[Load]) -> list[Load]:
        """The step's loads with their blocks pinned: those the scheduler read from the lookup
        table (lease 0) get one Match for all of them; where it finds fewer blocks than the
        table did (evicted since), the pages past them are failed loads (vLLM recomputes)."""
        table = [ld for ld in loads if not ld.lease_id]
        if not table:
            return list(loads)
        t0 = time.perf_counter()

        def run(client: Client) -> list[LeaseMatch]:
            found = client.match_many([(ld.namespace, ld.tokens) for ld in table])
            for m in found:
                self.link.check_answer(client, m.epoch)
            return found

        try:
            found = self.link.call(run)
        except (Down, LayoutMismatch):
            found = []
        pinned = [ld for ld in loads if ld.lease_id]
        for i, ld in enumerate(table):
            m = found[i] if found else None
            blocks = m.block_ids[ld.first_block:ld.first_block + len(ld.pages)] if m else ()
            if len(blocks) < len(ld.pages):
                self._failed(Load(ld.req_id, 0, "", (), ld.pages[len(blocks):]), 0.0, {})
            if blocks and m is not None:
                pinned.append(Load(ld.req_id, m.lease_id, m.epoch, blocks,
                                   ld.pages[:len(blocks)]))
            elif m is not None:
                self._release(m.lease_id)
            self.stats.record(side="worker", op="pin", req=ld.req_id,
                              s=(time.perf_counter() - t0) / len(table), blocks=len(blocks),
                              planned=len(ld.pages))
        return pinned

    def _release(self, lease_id: int) -> None:
        try:
            self.link.call(lambda c: c.release(lease_id))
        except Down:
            pass  # its TTL ends it

    def start_loads(self, loads: Sequence[Load]) -> None:
        """Start the step's loads: layer by layer beside the forward where there is a loader,
        else whole, now."""
        loads = self.pin(loads)
        if self.loader is None:
            self.load(loads)
            return
        self.finish_loads()  # a previous step's, should it not have been finished
        ready: list[tuple[Load, torch.Tensor]] = []
        for ld in loads:
            def view_of(client: Client, ld: Load = ld) -> torch.Tensor:
                return self.link.checked_pool(client, ld.epoch).view()

            try:
                view = self.link.call(view_of)
                self.pages()
            except (Down, LayoutError) as e:
                if isinstance(e, LayoutError):
                    self.link.log.error("radixkv: cannot map vLLM's KV pages: %s", e)
                self._failed(ld, 0.0, {})
                continue
            ready.append((ld, view))
        if ready:
            self.loader.start(ready, self.layers, self.pages())

    def wait_layer(self, name: str) -> None:
        if self.loader is not None:
            self.loader.wait_layer(name)

    def finish_loads(self) -> None:
        """Wait for the step's layer-wise loads; their failed pages go to `failed_pages`."""
        loader = self.loader
        done = loader.finish_if_pending() if loader is not None else None
        if loader is None or done is None:
            return
        n = len(done.loads)
        for ld in done.loads:  # the step's costs, shared out (the loads were copied together)
            cost: dict[str, Any] = {
                "cpu_s": done.cpu_s / n, "copy_s": done.copy_s / n, "layerwise": True,
                "waited_layers": done.waited_layers,
                "loader_cpus": done.ran_on}  # where it ran: the engine's CPUs, or others
            if ld in done.failed:
                self._failed(ld, done.wait_s / n, cost)
            else:
                self.stats.record(side="worker", op="load", req=ld.req_id, ok=True,
                                  blocks=len(ld.blocks), s=done.wait_s / n, **cost)

    def _failed(self, ld: Load, s: float, cost: dict[str, Any]) -> None:
        self.link.log.warning("radixkv: loading %d blocks of request %s failed; vLLM "
                              "recomputes them", len(ld.pages), ld.req_id)
        self.failed_pages.update(ld.pages)
        self.stats.record(side="worker", op="load", req=ld.req_id, ok=False,
                          blocks=len(ld.blocks), s=s, **cost)

    def load(self, loads: Sequence[Load]) -> None:
        """Copy each load's blocks into its pages, whole, now; failed ones go to
        `failed_pages`."""
        for ld in loads:
            t0 = time.perf_counter()

            def run(client: Client, ld: Load = ld) -> bool:
                mapping = self.link.checked_pool(client, ld.epoch)
                self.pages().from_pool(self.layers, ld.pages, mapping.view(), ld.blocks)
                self._sync()
                return release_after_copy(client, ld.lease_id)

            try:
                ok = self.link.call(run)
            except (Down, LayoutError) as e:
                ok = False
                if isinstance(e, LayoutError):
                    self.link.log.error("radixkv: cannot map vLLM's KV pages: %s", e)
            if not ok:
                self.link.log.warning("radixkv: loading %d blocks of request %s failed; vLLM "
                                      "recomputes them", len(ld.pages), ld.req_id)
                self.failed_pages.update(ld.pages)
            self.stats.record(side="worker", op="load", req=ld.req_id, ok=ok,
                              blocks=len(ld.blocks), s=time.perf_counter() - t0)

    def save(self, saves: Sequence[Save]) -> None:
        """Copy each save's pages into its new blocks and Insert; every request is reported
        done (`sent`) whether or not it was stored."""
        self.finish_loads()  # the step's loads are done with the client and the pages
        for sv in saves:
            t0 = time.perf_counter()

            def run(client: Client, sv: Save = sv) -> bool:
                if not sv.lease_id:
                    sv = self._allocated(client, sv)
                    if not sv.new_blocks:
                        return True  # all cached already (by another engine meanwhile)
                mapping = self.link.checked_pool(client, sv.epoch)
                try:  # ours for COPY_TTL_S more (the server's cap permitting): safe to write
                    try:
                        client.keep_alive(sv.lease_id, ttl=COPY_TTL_S)
                    except InvalidArgument:
                        client.keep_alive(sv.lease_id)
                except (LeaseExpired, NotFound):
                    return False
                self.pages().to_pool(self.layers, sv.pages, mapping.view(), sv.new_blocks)
                self._sync()
                try:
                    client.insert(sv.namespace, sv.tokens, sv.blocks, sv.lease_id,
                                  epoch=sv.epoch, release=True)
                except (LeaseExpired, NotFound, StalePool):
                    return False
                return True

            try:
                ok = self.link.call(run)
            except Down:
                ok = False
            except LayoutError as e:
                ok = False
                self.link.log.error("radixkv: cannot map vLLM's KV pages: %s", e)
            if not ok:
                self.link.log.warning("radixkv: the KV of request %s was not stored (its lease "
                                      "ended or radixkv is unavailable)", sv.req_id)
            self.sent.add(sv.req_id)
            self.stats.record(side="worker", op="save", req=sv.req_id, ok=ok,
                              blocks=len(sv.new_blocks), s=time.perf_counter() - t0)

    def _allocated(self, client: Client, sv: Save) -> Save:
        """A save the scheduler planned from the lookup table: Match its tokens with
        allocation here; the cached blocks are pinned, new ones come for the rest."""
        m = client.match(sv.namespace, sv.tokens, store_tokens=STORE_ALL)
        self.link.check_answer(client, m.epoch, lambda: client.release(m.lease_id))
        k, new = len(m.block_ids), m.new_block_ids
        if not new:
            client.release(m.lease_id)
            return sv
        end = (k + len(new)) * self.block_size
        return Save(sv.req_id, m.lease_id, m.epoch, sv.namespace, sv.tokens[:end],
                    m.block_ids + new, new, sv.pages[k:k + len(new)])

    def take_sent(self) -> set[str]:
        sent, self.sent = self.sent, set()
        return sent

    def take_failed(self) -> set[int]:
        self.finish_loads()
        failed, self.failed_pages = self.failed_pages, set()
        return failed

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()
