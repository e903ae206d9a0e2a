"""The eviction policies by name: what a tree or a service asks for (`--policy`).

| name     | module                   | order                                                 |
| -------- | ------------------------ | ----------------------------------------------------- |
| lru      | radixkv.index.eviction   | least recently touched leaf first                     |
| lfu      | radixkv.index.eviction   | fewest hits first, then least recently touched        |
| adaptive | radixkv.index.adaptive   | ARC over the leaves, with ghosts and retention hints  |
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from radixkv.index.adaptive import AdaptiveState
from radixkv.index.eviction import EvictionPolicy, LFUPolicy, LRUPolicy
from radixkv.protocol.errors import InvalidArgument

PolicyFactory = Callable[[str], EvictionPolicy[Any]]


def policy_factory(name: str, capacity_blocks: int | None = None) -> PolicyFactory:
    """Makes the policies of trees that evict against one pool (a service's namespaces):
    factory(namespace) is a new, empty policy; their victims' keys compare across trees (with
    a shared clock), and an adaptive policy's state (target split, ghosts) is shared.
    `capacity_blocks`: the pool's size, which bounds the adaptive ghost list."""
    if name == "adaptive":
        state = AdaptiveState(capacity_blocks)
        return state.new_policy
    if name not in _REGISTRY:
        raise InvalidArgument(
            f"unknown eviction policy {name!r}; choose one of {', '.join(POLICIES)}")
    cls = _REGISTRY[name]
    return lambda namespace: cls()


def make_policy(name: str, capacity_blocks: int | None = None) -> EvictionPolicy[Any]:
    """A new, empty policy by name (one of POLICIES) for one tree."""
    return policy_factory(name, capacity_blocks)("")


_REGISTRY: dict[str, type[EvictionPolicy[Any]]] = {p.name: p for p in (LRUPolicy, LFUPolicy)}
POLICIES: tuple[str, ...] = (*_REGISTRY, "adaptive")
DEFAULT_POLICY = "adaptive"
