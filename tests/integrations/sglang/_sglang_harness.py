"""SGLang's real HiCacheController on CPU, as SGLang's own unit tests build it: a host KV pool
(MHATokenToKVPoolHost, page_first or page_first_direct) over stand-in device K/V buffers, and a
stand-in device allocator. Runs in .venv-sglang (imported by _sglang_worker.py beside it and
bench/hicache_bench.py); `write` backs pages up through write_storage and `prefetch` loads them
through prefetch -> batch_exists -> batch_get_v1, as SGLang's scheduler drives them."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.utils import get_hash_str
from sglang.srt.runtime_context import get_parallel


@dataclass(frozen=True)
class Geometry:
    layers: int = 2
    heads: int = 2
    head_dim: int = 8
    page_size: int = 4
    dtype: torch.dtype = torch.float32
    host_pages: int = 64


class DevicePool:
    """What the controller asks of SGLang's device KV pool on this path."""

    def __init__(self, g: Geometry) -> None:
        self.device = torch.device("cpu")
        self.layer_num = g.layers
        self.start_layer, self.end_layer = 0, g.layers - 1
        self.head_num, self.head_dim, self.dtype = g.heads, g.head_dim, g.dtype
        size = g.host_pages * g.page_size
        self.k_buffer = [torch.zeros(size, g.heads, g.head_dim, dtype=g.dtype)
                         for _ in range(g.layers)]
        self.v_buffer = [torch.zeros_like(k) for k in self.k_buffer]

    def register_layer_transfer_counter(self, counter: Any) -> None:
        self.layer_transfer_counter = counter


class DeviceAllocator:
    """The stand-in device allocator: the controller only asks it for its KV pool."""

    def __init__(self, pool: DevicePool) -> None:
        self.pool = pool

    def get_kvcache(self) -> DevicePool:
        return self.pool


def host_pool(g: Geometry, layout: str) -> MHATokenToKVPoolHost:
    dev = DevicePool(g)
    ptrs = [torch.tensor([t.data_ptr() for t in b], dtype=torch.uint64)
            for b in (dev.k_buffer, dev.v_buffer)]
    info = MHABufferInfo(
        buffers=KVBuffers(k=tuple(dev.k_buffer), v=tuple(dev.v_buffer), k_data_ptrs=ptrs[0],
                          v_data_ptrs=ptrs[1], layout=KVBufferLayout.NHD),
        page_size=g.page_size, head_num=g.heads, head_dim=g.head_dim, v_head_dim=g.head_dim,
        dtype=g.dtype, device=torch.device("cpu"))
    return MHATokenToKVPoolHost(
        info, 1.0, 0, g.page_size, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=g.host_pages * g.page_size, start_layer=0,
        end_layer=g.layers - 1, host_token_capacity=g.host_pages * g.page_size)


def set_rank(tp_rank: int = 0, tp_size: int = 1) -> None:
    """The parallel topology SGLang's storage config reads (one process, no groups)."""
    get_parallel().override_permanently(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0,
                                        pp_size=1, attn_dcp_size=1, attn_dcp_rank=0)


def controller(g: Geometry, layout: str, backend: str, extra: dict[str, Any] | None,
               model: str = "tiny") -> HiCacheController:
    host = host_pool(g, layout)
    return HiCacheController(
        DeviceAllocator(DevicePool(g)), host, g.page_size, None, threading.Event(),
        io_backend="direct" if layout == "page_first_direct" else "kernel",
        storage_backend=backend, prefetch_threshold=g.page_size, model_name=model,
        storage_backend_extra_config=extra)


def page_keys(tokens: list[int], page_size: int) -> list[str]:
    """SGLang's chain hash per page (64 hex digits each)."""
    keys: list[str] = []
    for i in range(0, len(tokens) - len(tokens) % page_size, page_size):
        keys.append(get_hash_str(tokens[i:i + page_size], keys[-1] if keys else None))
    return keys


def fill(cc: HiCacheController, slots: torch.Tensor, seed: int) -> None:
    """Distinct values in the host pool's `slots` (every layer, K and V)."""
    host = cc.mem_pool_host
    gen = torch.Generator().manual_seed(seed)
    for i in range(0, len(slots), host.page_size):
        page = torch.randn(host.get_dummy_flat_data_page().shape, generator=gen)
        host.set_from_flat_data_page(int(slots[i]), page.to(host.dtype))


def page_bytes(cc: HiCacheController, slots: torch.Tensor) -> list[bytes]:
    host = cc.mem_pool_host
    return [host.get_data_page(int(slots[i])).contiguous().numpy().tobytes()
            for i in range(0, len(slots), host.page_size)]


def write(cc: HiCacheController, slots: torch.Tensor, tokens: list[int],
          prefix: list[str] | None = None, timeout: float = 60.0) -> int:
    """write_storage of the pages in `slots`; the tokens the backup thread stored."""
    keys = page_keys(tokens, cc.page_size)
    op_id = cc.write_storage(slots, tokens, keys, prefix_keys=prefix)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        op = cc.ack_backup_queue.get(timeout=timeout)
        if op.id == op_id:
            return int(op.completed_tokens)
    raise TimeoutError("no backup ack")


def prefetch(cc: HiCacheController, rid: str, tokens: list[int],
             timeout: float = 60.0) -> tuple[int, int, torch.Tensor | None]:
    """prefetch as the scheduler drives it: the hit query, host slots for the hits, the
    transfer; returns (tokens the hit query found, tokens loaded, the slots)."""
    op = cc.prefetch(rid, tokens, None, [])
    hit = cc.prefetch_hit_queue.get(timeout=timeout)
    assert hit is op
    if not op.storage_hit_count:
        return 0, 0, None
    op.host_indices = cc.mem_pool_host.alloc(op.storage_hit_count)
    cc.prefetch_buffer.put(op)
    loaded = 0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ack = cc.ack_prefetch_queue.get(timeout=timeout)
        if ack.operation is not op:
            continue
        if ack.completed_tokens is not None:
            loaded = ack.completed_tokens
        if ack.completed_req:
            return op.storage_hit_count, loaded, op.host_indices
    raise TimeoutError("no prefetch completion")
