"""The service's namespaces by name: created on first use, of the one kind the pool's layout
chose (or key-keyed, radixkv.service.keyed, where the first call gives keys), and dropped when they
hold no blocks and no leases (their lifetime counters stay, in `retired`)."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Iterator

from radixkv.index.policies import PolicyFactory
from radixkv.protocol.errors import FailedPrecondition, LimitExceeded
from radixkv.service.keyed import KeyNamespace
from radixkv.service.kinds import Counters, Namespace


class Namespaces:
    def __init__(self, kind: type[Namespace], block_size: int, window_blocks: int,
                 policies: PolicyFactory, max_namespaces: int) -> None:
        self.kind = kind
        self._block_size = block_size
        self._window_blocks = window_blocks
        # one policy state and one LRU clock for every namespace's tree: their victims compare
        self._policies = policies
        self._clock = functools.partial(next, itertools.count(1))
        self._max = max_namespaces
        self._by_name: dict[str, Namespace] = {}
        self.retired = Counters()  # lifetime counters of namespaces already dropped

    def __len__(self) -> int:
        return len(self._by_name)

    def __iter__(self) -> Iterator[Namespace]:
        return iter(self._by_name.values())

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __getitem__(self, name: str) -> Namespace:
        return self._by_name[name]

    def get(self, name: str) -> Namespace | None:
        return self._by_name.get(name)

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def check_room(self, new_namespaces: int) -> None:
        """LimitExceeded unless `new_namespaces` more may be created."""
        if new_namespaces and len(self._by_name) + new_namespaces > self._max:
            raise LimitExceeded(f"{len(self._by_name)} namespaces hold blocks or leases and "
                                f"{new_namespaces} more were asked for; limit {self._max}")

    def check_kinds(self, calls: Iterable[tuple[str, int]]) -> None:
        """FailedPrecondition unless each (name, key_size) of a batch is of its namespace's kind
        (key-keyed with that key size, or token-keyed for 0), for namespaces that exist or that
        an earlier call of the batch creates."""
        kinds: dict[str, int] = {}
        for name, key_size in calls:
            ns = self._by_name.get(name)
            have = kinds.setdefault(name, key_size if ns is None else ns.key_size)
            if have != key_size:
                raise FailedPrecondition(
                    f"namespace {name!r} is {_kind(have)}; this call gives {_kind(key_size)}")

    def open(self, name: str, key_size: int = 0) -> Namespace:
        """The namespace, created if absent (callers checked the limit and `check_kinds`
        first): key-keyed with `key_size`-byte keys, else of the pool's kind."""
        ns = self._by_name.get(name)
        if ns is None:
            if key_size:
                ns = KeyNamespace(name, self._block_size, key_size, self._policies(name),
                                  self._clock)
            else:
                ns = self.kind(name, self._block_size, self._window_blocks,
                               self._policies(name), self._clock)
            self._by_name[name] = ns
        return ns

    def drop(self, ns: Namespace) -> None:
        """Forget a namespace that holds no blocks and no leases; its counters stay."""
        self.retired.add(ns.life)
        del self._by_name[ns.name]

    def drop_if_empty(self, ns: Namespace) -> None:
        if not ns.num_leases and not ns.tree.num_cached_blocks:
            self.drop(ns)

    def lifetime(self) -> Counters:
        """The request counters of every namespace, dropped ones included."""
        life = Counters()
        life.add(self.retired)
        for ns in self._by_name.values():
            life.add(ns.life)
        return life


def _kind(key_size: int) -> str:
    return f"key-keyed ({key_size}-byte keys)" if key_size else "token-keyed (tokens)"
