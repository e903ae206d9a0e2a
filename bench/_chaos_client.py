"""One bench/chaos.py client process: requests in a loop, verified, surviving what chaos does.

Per request: Match -> read the hit blocks and check their keys -> Allocate the rest -> write
their keys -> Insert -> Release. The keys are radixkv.replay.client's: a chained hash of namespace
+ token prefix in each block's first 8 bytes (written and read with its BlockBytes). Counters go
to a shared array the supervisor reads, so a SIGKILLed client's figures outlive it.

A read is proven to have happened under the lease that pinned its blocks when it finished within
the TTL of the Match request, or when the lease's Release succeeded afterwards; only proven
reads count as verified (or as mismatches). The Client's pool epoch is known before its first
Match, so an answer from another epoch moves kv.restarts: such an answer is discarded, its block
ids belong to a pool this client may not have mapped.
"""

from __future__ import annotations

import ctypes
import logging
import os
import random
import signal
import sys
import time
import traceback
from typing import Any

from radixkv.client import Client
from radixkv.protocol.errors import (
    LeaseExpired,
    NotFound,
    OutOfBlocks,
    RadixKVError,
    StalePool,
    Unavailable,
)
from radixkv.protocol.tokens import to_token_bytes
from radixkv.replay.client import BlockBytes, block_keys

NAMESPACES = ("chaos-a", "chaos-b", "chaos-c")

# Per-client shared counters (one RawArray each, so a SIGKILLed client's figures survive it).
COUNTERS = ("requests", "hit_tokens", "verified_blocks", "mismatches", "unconfirmed_reads",
            "unconfirmed_mismatches", "inserted_blocks", "discarded_answers", "reconnects",
            "unavailable", "not_found", "lease_expired", "stale_pool", "out_of_blocks",
            "other_errors", "internal_errors", "fatal", "epochs_noticed", "routed",
            "router_fallbacks", "in_lease")
C = {name: i for i, name in enumerate(COUNTERS)}


# ---- the workload ----------------------------------------------------------------------------


def conversations(seed: int, block_size: int) -> dict[str, list[list[list[int]]]]:
    """Per namespace, 24 conversations: a shared system prompt (one of 6) and 6 turns of 1-3
    blocks each. Every client derives the same ones from the seed, so prefixes are shared."""
    rng = random.Random(seed)
    out: dict[str, list[list[list[int]]]] = {}
    for ns in NAMESPACES:
        systems = [[rng.randrange(50_000) for _ in range(block_size * rng.randint(2, 8))]
                   for _ in range(6)]
        out[ns] = [[systems[c % 6]] + [[rng.randrange(50_000)
                                        for _ in range(block_size * rng.randint(1, 3))]
                                       for _ in range(6)]
                   for c in range(24)]
    return out


def next_prompt(rng: random.Random, convs: dict[str, list[list[list[int]]]],
                block_size: int) -> tuple[str, bytes]:
    """A namespace and a prompt: a conversation's first 1-6 turns, sometimes with a private tail
    (whole blocks and a partial one) that no other request shares."""
    ns = rng.choice(NAMESPACES)
    parts = rng.choice(convs[ns])
    tokens = [t for part in parts[: 1 + rng.randint(1, 6)] for t in part]
    if rng.random() < 0.3:
        tokens += [rng.randrange(50_000) for _ in range(block_size * rng.randint(0, 3)
                                                         + rng.randrange(block_size))]
    return ns, to_token_bytes(tokens)


# ---- one client process ----------------------------------------------------------------------


def error_tally(e: RadixKVError) -> str:
    """The tally an error counts under. A fault explains not_found (a lease of the previous
    server life), lease_expired and out_of_blocks; internal_errors and other_errors it never
    explains, and a run must have none."""
    for kind, tally in ((NotFound, "not_found"), (LeaseExpired, "lease_expired"),
                        (OutOfBlocks, "out_of_blocks")):
        if isinstance(e, kind):
            return tally
    internal = getattr(e, "code", "") in ("INTERNAL", "UNKNOWN")
    return "internal_errors" if internal else "other_errors"


def die_with_parent() -> None:
    """SIGKILL this process when the supervisor dies (Linux PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


class Worker:
    """One client's loop state: the Client, its pool bytes, the counters it publishes."""

    def __init__(self, args: dict[str, Any], counters: Any) -> None:
        self.args = args
        self.c = counters
        self.kv: Client | None = None
        self.pool: BlockBytes | None = None
        self.mapping: Any = None
        self.seq = 0  # requests sent; odd ones take two round trips, even ones four

    def bump(self, name: str, n: int = 1) -> None:
        self.c[C[name]] += n

    def connect(self) -> Client:
        """A Client whose pool epoch is known before its first Match (so that every later
        answer from another epoch moves kv.restarts)."""
        if self.kv is None:
            kv = Client(self.args["target"], timeout=10.0)
            try:
                self.attach(kv)
            except BaseException:
                kv.close()
                raise
            self.kv = kv
            self.bump("reconnects")
        return self.kv

    def attach(self, kv: Client) -> None:
        mapping = kv.pool()
        if mapping is not self.mapping:
            self.mapping, self.pool = mapping, BlockBytes(mapping)

    def drop(self) -> None:
        if self.kv is not None:
            self.kv.close()
        self.kv = self.pool = self.mapping = None

    def request(self, ns: str, tokens: bytes) -> None:
        """Match -> verify -> Allocate -> write -> Insert -> Release, once; every other request
        in two round trips (the Match allocates, the Insert releases)."""
        kv = self.connect()
        assert self.pool is not None
        bs, ttl = self.args["block_size"], self.args["lease_ttl"]
        keys = block_keys(ns, tokens, bs)
        restarts = kv.restarts
        sent = time.monotonic()
        self.seq += 1
        two = self.seq % 2
        m = kv.match(ns, tokens, store_tokens=len(tokens) // 4 if two else 0)
        self.c[C["in_lease"]] = 1
        try:
            if kv.restarts != restarts:  # answered by a new pool: ids not for our mapping
                self.bump("epochs_noticed", kv.restarts - restarts)
                self.bump("discarded_answers")
                kv.release(m.lease_id)  # the lease is the new server's: give it back
                self.attach(kv)
                return
            bad, read_in_ttl = -1, False
            if m.block_ids:
                got = self.pool.read(m.block_ids)
                read_in_ttl = time.monotonic() - sent < ttl
                wrong = [i for i in range(len(got)) if got[i] != keys[i]]
                bad = wrong[0] if wrong else -1
                self.bump("hit_tokens", m.num_tokens)
            released = False
            try:
                need = len(keys) - len(m.block_ids)
                new: tuple[int, ...] = m.new_block_ids[:need]
                if need > 0 and not new:
                    try:
                        new = kv.allocate(need, lease_id=m.lease_id).block_ids
                    except OutOfBlocks:
                        self.bump("out_of_blocks")
                if new and kv.restarts == restarts:  # (our own lease: always the same pool)
                    self.pool.write(new, keys[len(m.block_ids):])
                    kv.insert(ns, tokens, m.block_ids + new, m.lease_id,
                              m.epoch, release=bool(two))
                    self.bump("inserted_blocks", len(new))
                    released = bool(two)
                if not released:
                    kv.release(m.lease_id)
                    released = True
            finally:
                if m.block_ids:
                    self.verdict(m, keys, bad, read_in_ttl or released, ns)
            self.bump("requests")
        finally:
            self.c[C["in_lease"]] = 0

    def verdict(self, m: Any, keys: Any, bad: int, confirmed: bool, ns: str) -> None:
        if not confirmed:
            self.bump("unconfirmed_reads")
            if bad >= 0:
                self.bump("unconfirmed_mismatches")
            return
        self.bump("verified_blocks", len(m.block_ids))
        if bad >= 0:
            self.bump("mismatches")
            assert self.pool is not None
            got = self.pool.read(m.block_ids)
            print(f"MISMATCH pid {os.getpid()} namespace {ns}: block {bad} of the prefix "
                  f"(pool id {m.block_ids[bad]}, epoch {self.mapping.epoch}) expected "
                  f"{int(keys[bad]):#018x}, read {int(got[bad]):#018x}", file=sys.stderr,
                  flush=True)


def client_main(args: dict[str, Any], slot: int, counters: Any, stop: Any) -> None:
    """One client process: requests in a loop until `stop`; errors the service may answer
    under chaos are counted and survived, anything else ends the client (counted as fatal)."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor handles Ctrl-C
    logging.getLogger("radixkv.client.client").setLevel(logging.ERROR)  # restarts: counted instead
    rng = random.Random(args["seed"] * 1_000_003 + slot)
    convs = conversations(args["seed"], args["block_size"])
    w = Worker(args, counters)
    down_since = 0.0
    try:
        while not stop.is_set():
            ns, tokens = next_prompt(rng, convs, args["block_size"])
            try:
                w.request(ns, tokens)
                down_since = 0.0
            except Unavailable:
                # The server is down or restarting. The channel reconnects by itself (and the
                # next answer then carries the new epoch); a channel still down after 2 s may
                # be in gRPC's reconnect backoff, so a fresh Client replaces it.
                w.bump("unavailable")
                now = time.monotonic()
                down_since = down_since or now
                if now - down_since > 2.0:
                    w.drop()
                    down_since = 0.0
                time.sleep(0.05)
            except StalePool:  # the mapped segment is gone: attach afresh
                w.bump("stale_pool")
                w.drop()
            except RadixKVError as e:
                tally = error_tally(e)
                w.bump(tally)
                if tally.endswith("errors"):
                    print(f"client {slot}: {type(e).__name__} {getattr(e, 'code', '')}: {e}",
                          file=sys.stderr, flush=True)
    except BaseException:
        w.bump("fatal")
        print(f"client {slot} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    finally:
        w.drop()
