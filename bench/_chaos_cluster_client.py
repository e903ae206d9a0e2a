"""One client process of `bench/chaos.py --cluster`: an engine that routes through the router.

Per request: Route (namespace, prompt) -> the cheapest member -> the verified cycle of
bench/_chaos_client.py (`Worker.request`: Match, check the hit blocks' keys, Allocate, write,
Insert, Release) on that member's own Client. A member that fails with Unavailable is left out
of our routes for 2 s (as radixkv.cluster.routed.RoutedClient does). When the router itself
cannot answer (killed, restarting, or no member indexed yet) the request goes to a member the
router named before, chosen at random: engines keep serving while the router is away.
"""

from __future__ import annotations

import logging
import random
import signal
import sys
import time
import traceback
from typing import Any

from _chaos_client import (
    C,
    Worker,
    conversations,
    die_with_parent,
    error_tally,
    next_prompt,
)

from radixkv.cluster.routed import RouterClient
from radixkv.protocol.errors import (
    RadixKVError,
    StalePool,
    Unavailable,
)

EXCLUDE_S = 2.0


class _Engine:
    def __init__(self, args: dict[str, Any], counters: Any, rng: random.Random) -> None:
        self.args = args
        self.c = counters
        self.rng = rng
        self.router: RouterClient | None = None
        self.workers: dict[str, Worker] = {}
        self.known: dict[str, str] = {}  # node id -> address, from the router's answers
        self.failed: dict[str, float] = {}

    def bump(self, name: str, n: int = 1) -> None:
        self.c[C[name]] += n

    def choose(self, ns: str, tokens: bytes) -> tuple[str, str]:
        now = time.monotonic()
        exclude = [n for n, t in self.failed.items() if now - t < EXCLUDE_S]
        try:
            if self.router is None:
                self.router = RouterClient(self.args["router"], timeout=5.0)
            answer = self.router.route(ns, tokens, exclude)
            for m in answer.members:
                self.known[m.node_id] = m.address
            self.bump("routed")
            best = answer.members[0]
            others = [m for m in answer.members[1:] if m.node_id not in exclude]
            if self.args.get("spread") and others and self.rng.random() < 0.5:
                best = self.rng.choice(others)  # not the holder: it fetches (--peer-fetch)
            return best.node_id, best.address
        except RadixKVError:
            if self.router is not None:  # a fresh channel: no reconnect backoff to wait out
                self.router.close()
                self.router = None
            candidates = [n for n in self.known if n not in exclude] or list(self.known)
            if not candidates:
                raise Unavailable("no router and no member known yet") from None
            self.bump("router_fallbacks")
            node = self.rng.choice(sorted(candidates))
            return node, self.known[node]

    def worker(self, node: str, address: str) -> Worker:
        w = self.workers.get(node)
        if w is None or w.args["target"] != address:
            if w is not None:
                w.drop()
            w = self.workers[node] = Worker({**self.args, "target": address}, self.c)
        return w

    def close(self) -> None:
        for w in self.workers.values():
            w.drop()
        if self.router is not None:
            self.router.close()


def cluster_client_main(args: dict[str, Any], slot: int, counters: Any, stop: Any) -> None:
    """Requests in a loop until `stop`; what the cluster may answer under chaos is counted and
    survived, anything else ends the client (counted as fatal)."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.getLogger("radixkv").setLevel(logging.ERROR)
    rng = random.Random(args["seed"] * 1_000_003 + slot)
    convs = conversations(args["seed"], args["block_size"])
    engine = _Engine(args, counters, rng)
    try:
        while not stop.is_set():
            ns, tokens = next_prompt(rng, convs, args["block_size"])
            node = ""
            try:
                node, address = engine.choose(ns, tokens)
                engine.worker(node, address).request(ns, tokens)
            except Unavailable:
                engine.bump("unavailable")
                if node:
                    engine.failed[node] = time.monotonic()
                    engine.workers.pop(node).drop()
                time.sleep(0.05)
            except StalePool:
                engine.bump("stale_pool")
                engine.workers.pop(node).drop()
            except RadixKVError as e:
                tally = error_tally(e)
                engine.bump(tally)
                if tally.endswith("errors"):
                    print(f"client {slot} ({node}): {type(e).__name__} "
                          f"{getattr(e, 'code', '')}: {e}", file=sys.stderr, flush=True)
    except BaseException:
        engine.bump("fatal")
        print(f"client {slot} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    finally:
        engine.close()
