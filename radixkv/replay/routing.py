"""Where a replay client sends each request: one service, or the members of a cluster chosen by
a routing policy through a router (`radixkv replay --nodes N` / `--router ADDR`).

| policy        | the member for a request                                                   |
| ------------- | -------------------------------------------------------------------------- |
| cache-aware   | the router's Route answer: most cached prefix, least load (its cost)       |
| session       | affinity: rendezvous hash of the prompt's first two block keys (its chat)  |
| round-robin   | request index mod members                                                  |
| random        | seeded by the request index                                                |

Members come from the router (Route, or its member list for the other policies, re-read every
second). A member that fails a call (killed, restarting) is left out for a while and the
request is run again from the start on another member, so a replay survives a member's crash;
its hits are still verified block by block.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from radixkv.client import Client
from radixkv.cluster.routed import RoutedClient
from radixkv.protocol.errors import InvalidArgument, StalePool, Unavailable
from radixkv.replay.client import BlockBytes, ClientArgs

POLICIES = ("cache-aware", "session", "round-robin", "random")
ATTEMPTS = 20
REFRESH_S = 1.0

Request = Callable[[Any, BlockBytes | None], dict[str, int]]


class OneService:
    """Every request to one service."""

    names = ("",)

    def __init__(self, args: ClientArgs) -> None:
        self.kv = Client(args.target)
        self.kv.wait_ready()
        self.pool = BlockBytes(self.kv.pool()) if args.verify else None

    def run(self, index: int, namespace: str, tokens: bytes, keys: np.ndarray[Any, Any],
            request: Request) -> tuple[dict[str, int], int, int]:
        return request(self.kv, self.pool), -1, 0

    def close(self) -> None:
        self.kv.close()


class Members:
    """Each request to the member a policy picks; (record, route ns or -1, member index)."""

    def __init__(self, args: ClientArgs) -> None:
        if args.routing not in POLICIES:
            raise InvalidArgument(f"routing {args.routing!r}: one of {', '.join(POLICIES)}")
        self.args = args
        self.routed = RoutedClient(args.router)
        self.names: list[str] = []  # node ids in order of first use: the records' member index
        self._pools: dict[str, BlockBytes] = {}
        self._members: list[dict[str, Any]] = []
        self._read_at = 0.0
        self.routed.router.wait_members(1)

    def run(self, index: int, namespace: str, tokens: bytes, keys: np.ndarray[Any, Any],
            request: Request) -> tuple[dict[str, int], int, int]:
        last: Exception | None = None
        for _ in range(ATTEMPTS):
            t = time.perf_counter_ns()
            node, address, epoch = self._choose(index, namespace, tokens, keys)
            route_ns = time.perf_counter_ns() - t if self.args.routing == "cache-aware" else -1
            try:
                kv = self.routed.member(node, address)
                pool = self._pool(node, kv, epoch)
                row = request(kv, pool)
            except (Unavailable, StalePool) as e:  # died or restarted mid-request: elsewhere
                last = e
                self.routed.failed(node)
                self._pools.pop(node, None)
                self._read_at = 0.0
                time.sleep(0.05)
                continue
            if node not in self.names:
                self.names.append(node)
            return row, route_ns, self.names.index(node)
        raise Unavailable(f"request {index}: no member completed it in {ATTEMPTS} attempts: "
                          f"{last}")

    def _pool(self, node: str, kv: Client, epoch: str) -> BlockBytes | None:
        if not self.args.verify:
            return None
        pool = self._pools.get(node)
        if pool is None or (epoch and pool.epoch != epoch):
            if pool is not None:  # the member restarted: a fresh client and mapping
                self.routed.failed(node)
                kv = self.routed.member(node, kv.target)
            pool = self._pools[node] = BlockBytes(kv.pool(refresh=True))
        return pool

    def _choose(self, index: int, namespace: str, tokens: bytes,
                keys: np.ndarray[Any, Any]) -> tuple[str, str, str]:
        policy = self.args.routing
        if policy == "cache-aware" and tokens:
            best = self.routed.route(namespace, tokens).members[0]
            return best.node_id, best.address, best.epoch
        members = self._healthy()
        if policy == "session":
            key = keys[:2].tobytes() if len(keys) else tokens[:64]
            m = max(members, key=lambda m: hashlib.blake2b(
                key + m["node_id"].encode(), digest_size=8).digest())
        elif policy == "random":
            m = members[random.Random(index).randrange(len(members))]
        else:
            m = members[index % len(members)]
        return m["node_id"], m["address"], m["epoch"]

    def _healthy(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        if now - self._read_at > REFRESH_S or not self._members:
            out = self.routed.router.members()["members"]
            excluded = set(self.routed.excluded())
            self._members = sorted((m for m in out if m["state"] == "indexed"
                                    and m["node_id"] not in excluded),
                                   key=lambda m: m["node_id"])
            self._read_at = now
            if not self._members:
                raise Unavailable(f"no healthy member behind router {self.args.router}")
        return self._members

    def close(self) -> None:
        self.routed.close()
