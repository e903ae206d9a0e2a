"""Which engine serves a prompt: the cluster index's cached prefix per engine's member, and the
load this gateway put on each.

    cost(e) = prompt tokens - tokens cached on e's member (whole blocks)
              + block_size x (e's requests in flight from this gateway + its member's leases)

the cost of radixkv's router (radixkv/cluster/router.py) with the gateway's own in-flight count
as the load: a request waiting on an engine weighs one block of prefill. Engines that are down
(engines.py) come after those that are up; ties go to the fewest in flight, then the URL. The
index is advisory: a stale answer costs a miss, never a wrong answer (the engine's connector
matches the tokens)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from radixkv.cluster.router import Router
from radixkv.gateway.engines import EngineServer
from radixkv.protocol.errors import RadixKVError
from radixkv.protocol.tokens import to_token_bytes

log = logging.getLogger("radixkv.gateway")

NOMINAL_BLOCK = 16  # the load's weight in tokens where no member says its block size


@dataclass(frozen=True, slots=True)
class Choice:
    ranked: tuple[EngineServer, ...]  # best first: up engines, then those in backoff
    reason: str  # "prefix": the best holds a cached prefix; "load": nobody does; "no_index"
    cached_tokens: dict[str, int]  # engine url -> prompt tokens its member holds cached


def choose(engines: list[EngineServer], router: Router | None, namespace: str,
           tokens: list[int]) -> Choice:
    """Rank `engines` for the prompt `tokens` in `namespace` (module docstring)."""
    cached = dict.fromkeys((e.url for e in engines), 0)
    leases: dict[str, int] = {}
    block, reason = NOMINAL_BLOCK, "load"
    if router is not None and tokens:
        try:
            answer = router.route(namespace, to_token_bytes(tokens), probe=True)
        except RadixKVError as err:  # no member indexed yet, a namespace it cannot take
            log.debug("no index answer: %s", err)
            reason = "no_index"
        else:
            block = answer.block_size
            by_node = {m.node_id: m for m in answer.members}
            for e in engines:
                m = by_node.get(e.node_id)
                if m is not None:
                    cached[e.url] = m.cached_tokens
                    leases[e.url] = int(m.load)
    now = time.monotonic()
    n = len(tokens)

    def cost(e: EngineServer) -> tuple[bool, float, int, str]:
        load = e.inflight + leases.get(e.url, 0)
        return (not e.up(now), n - cached[e.url] + block * load, e.inflight, e.url)

    ranked = tuple(sorted(engines, key=cost))
    if ranked and cached[ranked[0].url] > 0:
        reason = "prefix"
    return Choice(ranked, reason, cached)
