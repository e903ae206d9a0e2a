"""Test helpers for an in-process KVService on a tiny host pool (block_size 4, 16-byte
tokens per block, 128-byte blocks)."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpool import create_pool
from kvpool.layout import KVLayout
from radixkv.service import KVService, ServiceConfig

BS = 4


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_service(clock: Any = None, num_blocks: int = 8, **config: Any) -> KVService:
    """A service with a 10 s lease TTL (unless `config` says otherwise) on `num_blocks`."""
    pool = create_pool(KVLayout(1, 1, 4, "fp32", BS), num_blocks=num_blocks)
    cfg = ServiceConfig(**{"lease_ttl_s": 10, **config})
    return KVService(pool, cfg) if clock is None else KVService(pool, cfg, clock=clock)


def toks(*ids: int) -> bytes:
    return np.asarray(ids, dtype="<u4").tobytes()


def fill(svc: KVService, ns: str, tokens: bytes, owner: str = "e") -> tuple[int, ...]:
    """One full request (Match, Allocate, Insert, Release); returns the prompt's block ids."""
    m = svc.match(owner, ns, tokens)
    need = len(tokens) // 4 // BS - len(m.block_ids)
    new = svc.allocate(owner, m.lease_id, ns, need).block_ids if need else ()
    svc.insert(owner, m.lease_id, ns, tokens, m.block_ids + new)
    svc.release(owner, [m.lease_id])
    return m.block_ids + new
