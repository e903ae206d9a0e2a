"""What the vLLM connector's scheduler side hands its worker side each step (in the connector's
metadata): the loads to run before the forward and the saves after it. The worker imports these,
never the scheduler."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Load:
    """Copy pool `blocks` into vLLM `pages` (same order), then end lease `lease_id`. Lease 0: the
    scheduler read the prefix from the lookup table and pinned nothing; the worker pins it first
    (a Match of `tokens` in `namespace`: its blocks from `first_block` on are the pages')."""

    req_id: str
    lease_id: int
    epoch: str
    blocks: tuple[int, ...]
    pages: tuple[int, ...]
    namespace: str = ""
    tokens: tuple[int, ...] = ()
    first_block: int = 0


@dataclass(frozen=True, slots=True)
class Save:
    """Copy vLLM `pages` into the pool's `new_blocks`, then Insert `tokens` with `blocks`
    (the cached ones, then the new ones) and end lease `lease_id`. Lease 0: nothing allocated
    yet; the worker's Match of `tokens` allocates, and `pages` are all the tokens' pages."""

    req_id: str
    lease_id: int
    epoch: str
    namespace: str
    tokens: tuple[int, ...]
    blocks: tuple[int, ...]
    new_blocks: tuple[int, ...]
    pages: tuple[int, ...]
