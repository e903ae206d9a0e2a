"""SGLang's generic storage interface (one page at a time, as flat tensors of its dummy page
shape [2, layers, page, heads, dim]), for RadixKVStore; the v1 zero-copy calls are store.py's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch

from radixkv.client import Client
from radixkv.integrations.releaser import Releaser
from radixkv.integrations.sglang.keys import KeyPaths
from radixkv.protocol.values import LeaseMatch

T = TypeVar("T")


class _Backend(Protocol):
    """What these calls use of RadixKVStore."""

    namespace: str
    want: tuple[int, int, int, str, int]  # layers, heads, head_dim, dtype, page size
    keys: KeyPaths
    releaser: Releaser

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int: ...

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]: ...

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool: ...

    def _match(self, client: Client, path: list[bytes], store: bool = False,
               ttl: float = 0.0) -> LeaseMatch: ...

    def _call(self, fn: Callable[[Client], T], failed: T) -> T: ...


class FlatPages:
    """The generic interface as a mixin of RadixKVStore."""

    def exists(self: _Backend, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self: _Backend, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        got = self.batch_get([key], [target_location])
        return got[0] if isinstance(got, list) else None

    def batch_get(self: _Backend, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Pages as flat tensors of SGLang's dummy page shape [2, layers, page, heads, dim]
        (into `target_locations` where given); None from the first miss on."""
        self.releaser.wait_inserts()
        path, _ = self.keys.path(keys, None)
        out: list[torch.Tensor | None] = [None] * len(keys)
        if path is None:
            return out

        def run(client: Client) -> bool:
            m = self._match(client, path)
            try:
                view = client.pool_of(m.epoch).view()
                for i, b in enumerate(m.block_ids):
                    page = view[b].transpose(0, 1).flatten()  # [2, layers, page, heads, dim]
                    if target_locations is not None and target_locations[i] is not None:
                        target_locations[i].copy_(page)
                        out[i] = target_locations[i]
                    else:
                        out[i] = page.clone()
            finally:
                client.release(m.lease_id)
            return True

        return out if self._call(run, False) else [None] * len(keys)

    def set(self: _Backend, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self: _Backend, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store flat pages in SGLang's dummy page shape [2, layers, page, heads, dim]."""
        path, _ = self.keys.path(keys, None)
        if path is None or values is None or len(values) != len(keys):
            return False

        def run(client: Client) -> bool:
            m = self._match(client, path, store=True)
            if m.alloc_error:
                client.release(m.lease_id)
                return False
            view = client.pool_of(m.epoch).view()
            layers, heads, dim, _, page = self.want
            for b, value in zip(m.new_block_ids, values[len(m.block_ids):], strict=True):
                view[b] = value.reshape(2, layers, page, heads, dim).transpose(0, 1)
            client.insert_keys(self.namespace, path, m.block_ids + m.new_block_ids,
                               m.lease_id, epoch=m.epoch, release=True)
            return True

        return self._call(run, False)
