"""The ceiling of bench/hicache_bench.py: a HiCache storage backend with no IPC at all, loaded
by SGLang's controller in the bench worker (.venv-sglang) like radixkv's. Each stored page is a
copy in this process's memory (a dict from key to a block of one preallocated tensor in
radixkv's canonical [layers, 2, page, heads, dim] order), copied with the HostPages routine
radixkv's backend uses. What it reaches is what any backend can reach through SGLang's
controller on this machine: it pays the controller's own work and the copies, nothing else.
With `"copy": false` in the extra config it copies nothing (answers as if it had): what is left
is the controller's own work, the floor under every backend's batch."""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from radixkv.integrations.layout import HostPages


class CeilingStore(HiCacheStorage):  # type: ignore[misc]
    """Pages in a dict; `blocks` in the extra config: how many pages it holds (default 4096;
    when full, it forgets every page and starts over); `copy` (default true): false skips the
    copies."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self.capacity = int(extra.get("blocks", 4096))
        self.copying = bool(extra.get("copy", True))
        self.where: dict[str, int] = {}
        self.next = 0

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        host = mem_pool_host
        self.pages = HostPages(host.layout, host.page_size)
        self.pool = torch.empty(self.capacity, host.layer_num, 2, host.page_size,
                                host.head_num, host.head_dim, dtype=host.dtype)
        self.pool.fill_(0)  # touched: no first-touch page faults in the timed copies

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        for i, key in enumerate(keys):
            if key not in self.where:
                return i
        return len(keys)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        blocks = []
        for key in keys:
            if key not in self.where:
                break
            blocks.append(self.where[key])
        page = self.mem_pool_host.page_size
        slots = host_indices[:len(blocks) * page][::page].to(torch.long)
        if self.copying:
            self.pages.copy(self.mem_pool_host.kv_buffer, slots, self.pool, blocks,
                            to_pool=False)
        return [True] * len(blocks) + [False] * (len(keys) - len(blocks))

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        if self.next + len(keys) > self.capacity:
            self.next = 0
            self.where.clear()
        blocks = list(range(self.next, self.next + len(keys)))
        self.next += len(keys)
        page = self.mem_pool_host.page_size
        slots = host_indices[::page].to(torch.long)
        if self.copying:
            self.pages.copy(self.mem_pool_host.kv_buffer, slots, self.pool, blocks,
                            to_pool=True)
        self.where.update(zip(keys, blocks, strict=True))
        return [True] * len(keys)

    # the generic interface: unused with interface_v1
    def exists(self, key: str) -> bool:
        return key in self.where

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return None

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> Any:
        return [None] * len(keys)

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return False

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        return False

    def clear(self) -> None:
        self.where.clear()
