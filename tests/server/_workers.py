"""Engine-like worker functions run in separate (spawned) processes by the service tests."""

from __future__ import annotations

import os
import random
import time
import zlib

import numpy as np
import torch

from radixkv.client import Client
from radixkv.protocol.errors import RadixKVError

BLOCK_SIZE = 4


def block_pattern(namespace: str, tokens: list[int], index: int, shape: torch.Size) -> torch.Tensor:
    """The KV bytes a writer puts in block `index` of `tokens`: derived from the namespace and
    the token prefix up to the end of that block, so any reader can recompute them."""
    prefix = np.asarray(tokens[: (index + 1) * BLOCK_SIZE], dtype="<u4").tobytes()
    seed = zlib.crc32(namespace.encode() + prefix)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen)


def write_prompt(sock: str, namespace: str, tokens: list[int]) -> dict[str, object]:
    """Match -> Allocate -> write KV through the mapping -> Insert -> Release."""
    with Client(sock) as kv:
        view = kv.pool().view()
        with kv.lease(namespace, tokens) as lease:
            num_full = len(tokens) // BLOCK_SIZE
            cached = len(lease.block_ids)
            new = lease.allocate(num_full - cached) if num_full > cached else ()
            for i, b in enumerate(new):
                view[b] = block_pattern(namespace, tokens, cached + i, view[b].shape)
            result = lease.insert(tokens, lease.block_ids + new)
        return {"matched": lease.num_tokens, "new": list(new), "adopted": list(result.adopted)}


def read_prompt(sock: str, namespace: str, tokens: list[int]) -> dict[str, object]:
    """Match and check every matched block holds the writer's bytes."""
    with Client(sock) as kv:
        view = kv.pool().view()
        with kv.lease(namespace, tokens) as lease:
            ok = [bool(torch.equal(view[b], block_pattern(namespace, tokens, i, view[b].shape)))
                  for i, b in enumerate(lease.block_ids)]
        return {"matched": lease.num_tokens, "block_ids": list(lease.block_ids), "ok": ok}


def hold_lease_then_hang(sock: str, namespace: str, tokens: list[int], ready_path: str) -> None:
    """Open a lease, allocate, then wait to be SIGKILLed."""
    kv = Client(sock)
    m = kv.match(namespace, tokens)
    kv.allocate(2, lease_id=m.lease_id)
    with open(ready_path, "w") as f:
        f.write(str(os.getpid()))
    while True:
        time.sleep(1)


def random_traffic(sock: str, seed: int, seconds: float) -> dict[str, int]:
    """Random match / allocate / insert / release for a bounded time; counts outcomes."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50) for _ in range(8)] for _ in range(3)]
    counts = {"requests": 0, "errors": 0, "out_of_blocks": 0}
    deadline = time.monotonic() + seconds
    with Client(sock) as kv:
        while time.monotonic() < deadline:
            namespace = rng.choice(["a", "b"])
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(13))]
            counts["requests"] += 1
            try:
                with kv.lease(namespace, tokens) as lease:
                    need = len(tokens) // BLOCK_SIZE - len(lease.block_ids)
                    if need > 0 and rng.random() < 0.9:
                        new = lease.allocate(need)
                        if rng.random() < 0.8:
                            lease.insert(tokens, lease.block_ids + new)
            except RadixKVError as e:
                key = "out_of_blocks" if e.code == "RESOURCE_EXHAUSTED" else "errors"
                counts[key] += 1
    return counts
