"""Chaos: a verified replay while clients and the server are SIGKILLed and the server restarts.

    python bench/chaos.py --minutes 10 [--clients 4] [--json]
    python bench/chaos.py --seconds 30 --clients 3 --json          # what CI runs

    supervisor (this process)                      client processes (spawn) x N
    start_server(socket) ---------------------->   Match -> read the hit blocks, check their keys
    every ~--kill-every s: SIGKILL a client that   -> Allocate the rest -> write their keys
      holds a lease, spawn a replacement           -> Insert -> Release, in a loop; on Unavailable
    every ~--restart-every s: Stats integrity        a new Client; answers that crossed a pool
      check, SIGKILL the server, start_server        epoch change are discarded, not trusted
      again on the same socket (new epoch)
    at the end: stop the clients, wait past the lease TTL, Stats: no lease and no block may be
    left leased or pinned, free + cached == total, integrity ok; SIGTERM the server; no
    shared-memory segment of any server this run started may remain.

Every full block's first 8 bytes are its key: a chained hash of namespace + token prefix
(radixkv.replay.client.block_keys, written and read with its BlockBytes), so a hit block holding
anything but its own prefix's bytes is a mismatch. A read counts only once it is proven to have
happened under the lease that pinned the blocks: it finished within the TTL of the Match request,
or the lease's later Release succeeded (mismatches outside that proof are reported apart, as
unconfirmed). A client that sees a Match or Allocate answer from another pool epoch than the
mapping it holds (kv.restarts moved during the call) discards the answer: its block ids belong to
a pool it may not have mapped.

Prints progress on stderr, one summary line (or JSON with --json) on stdout; exit status 1 on a
mismatch, a leak, a failed integrity check, a left segment or an unexpected client error.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import multiprocessing as mp
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit  # noqa: E402

from radixkv.client import Client  # noqa: E402
from radixkv.errors import (  # noqa: E402
    LeaseExpired,
    NotFound,
    OutOfBlocks,
    RadixKVError,
    StalePool,
    Unavailable,
)
from radixkv.replay.client import BlockBytes, block_keys  # noqa: E402
from radixkv.server.launch import ServerProcess, start_server  # noqa: E402
from radixkv.tokens import to_token_bytes  # noqa: E402

# 2 layers x 2 kv heads x head_dim 8, fp32: 1 KiB per 4-token block
LAYOUT = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "hidden_size": 32, "torch_dtype": "float32"}
NAMESPACES = ("chaos-a", "chaos-b", "chaos-c")
SHM_DIR = "/dev/shm"

# Per-client shared counters (one RawArray each, so a SIGKILLed client's figures survive it).
COUNTERS = ("requests", "hit_tokens", "verified_blocks", "mismatches", "unconfirmed_reads",
            "unconfirmed_mismatches", "inserted_blocks", "discarded_answers", "reconnects",
            "unavailable", "not_found", "lease_expired", "stale_pool", "out_of_blocks",
            "other_errors", "internal_errors", "fatal", "epochs_noticed", "in_lease")
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


def _die_with_parent() -> None:
    """SIGKILL this process when the supervisor dies (Linux PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


class _Worker:
    """One client's loop state: the Client, its pool bytes, the counters it publishes."""

    def __init__(self, args: dict[str, Any], counters: Any) -> None:
        self.args = args
        self.c = counters
        self.kv: Client | None = None
        self.pool: BlockBytes | None = None
        self.mapping: Any = None

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
        """Match -> verify -> Allocate -> write -> Insert -> Release, once."""
        kv = self.connect()
        assert self.pool is not None
        bs, ttl = self.args["block_size"], self.args["lease_ttl"]
        keys = block_keys(ns, tokens, bs)
        restarts = kv.restarts
        sent = time.monotonic()
        m = kv.match(ns, tokens)
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
                new: tuple[int, ...] = ()
                if need > 0:
                    try:
                        new = kv.allocate(need, lease_id=m.lease_id).block_ids
                    except OutOfBlocks:
                        self.bump("out_of_blocks")
                if new and kv.restarts == restarts:  # (our own lease: always the same pool)
                    self.pool.write(new, keys[len(m.block_ids):])
                    kv.insert(ns, tokens, m.block_ids + new, m.lease_id)
                    self.bump("inserted_blocks", len(new))
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
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor handles Ctrl-C
    logging.getLogger("radixkv.client").setLevel(logging.ERROR)  # restarts: counted instead
    rng = random.Random(args["seed"] * 1_000_003 + slot)
    convs = conversations(args["seed"], args["block_size"])
    w = _Worker(args, counters)
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
            except NotFound:  # a lease of the previous server life
                w.bump("not_found")
            except LeaseExpired:
                w.bump("lease_expired")
            except OutOfBlocks:
                w.bump("out_of_blocks")
            except RadixKVError as e:
                w.bump("internal_errors" if getattr(e, "code", "") in ("INTERNAL", "UNKNOWN")
                       else "other_errors")
                print(f"client {slot}: {type(e).__name__} {getattr(e, 'code', '')}: {e}",
                      file=sys.stderr, flush=True)
    except BaseException:
        w.bump("fatal")
        print(f"client {slot} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    finally:
        w.drop()


# ---- the supervisor --------------------------------------------------------------------------


def _shm_names() -> set[str]:
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith("radixkv-")}
    except FileNotFoundError:
        return set()


def _owner_pid(name: str) -> int:
    """The owner pid in a host pool's segment name `radixkv-<pid>-<epoch>` (-1 if none)."""
    m = re.fullmatch(r"radixkv-(\d+)-[0-9a-f]+", name)
    return int(m.group(1)) if m else -1


class Chaos:
    def __init__(self, a: argparse.Namespace, directory: str) -> None:
        self.a = a
        self.rng = random.Random(a.seed)
        self.socket = os.path.join(directory, "s.sock")
        config = os.path.join(directory, "config.json")
        with open(config, "w") as f:
            json.dump(LAYOUT, f)
        self.flags = ("--model-config", config, "--block-size", str(a.block_size),
                      "--num-blocks", str(a.num_blocks), "--lease-ttl", str(a.lease_ttl))
        self.ctx = mp.get_context("spawn")
        self.stop_clients = self.ctx.Event()
        self.client_args = {"target": self.socket, "block_size": a.block_size,
                            "lease_ttl": a.lease_ttl, "seed": a.seed}
        self.clients: list[tuple[Any, Any]] = []  # (process, counters), live ones
        self.all_counters: list[Any] = []
        self.server_pids: list[int] = []
        self.server: ServerProcess | None = None
        self.kills = self.kills_mid_lease = self.restarts = self.integrity_failures = 0
        self.server_crashes = 0
        self.slot = 0

    # -- processes --

    def start_server(self) -> None:
        for attempt in range(5):
            try:
                self.server = start_server(self.socket, *self.flags)
                self.server_pids.append(self.server.proc.pid)
                return
            except Unavailable:
                if attempt == 4:
                    raise
                time.sleep(0.5)

    def spawn_client(self) -> None:
        counters = self.ctx.RawArray("q", len(COUNTERS))
        p = self.ctx.Process(target=client_main,
                             args=(self.client_args, self.slot, counters, self.stop_clients),
                             daemon=True)
        self.slot += 1
        p.start()
        self.clients.append((p, counters))
        self.all_counters.append(counters)

    def kill_client(self) -> None:
        """SIGKILL a random client, preferably while it holds a lease; spawn a replacement."""
        i = self.rng.randrange(len(self.clients))
        p, counters = self.clients.pop(i)
        deadline = time.monotonic() + 0.5
        while not counters[C["in_lease"]] and time.monotonic() < deadline:
            time.sleep(0.002)
        mid_lease = bool(counters[C["in_lease"]])
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        self.kills += 1
        self.kills_mid_lease += mid_lease
        self.spawn_client()

    def restart_server(self) -> None:
        """Check integrity under load, then SIGKILL the server and start it on the socket."""
        assert self.server is not None
        try:
            with Client(self.socket, timeout=10.0) as kv:
                integrity = kv.stats(check_integrity=True)["integrity"]
            if integrity != "ok":
                self.integrity_failures += 1
                log(f"integrity check failed before restart {self.restarts + 1}: {integrity}")
        except RadixKVError as e:
            log(f"Stats before restart {self.restarts + 1} failed: {e}")
        self.server.stop(signal.SIGKILL)
        self.start_server()
        self.restarts += 1

    def totals(self) -> dict[str, int]:
        return {name: sum(int(c[i]) for c in self.all_counters)
                for name, i in C.items() if name != "in_lease"}

    # -- the run --

    def run(self) -> dict[str, Any]:
        a = self.a
        shm_before = _shm_names()
        self.start_server()
        for _ in range(a.clients):
            self.spawn_client()
        t0 = time.monotonic()
        end = t0 + a.seconds
        next_kill = t0 + a.kill_every * self.rng.uniform(0.5, 1.5)
        next_restart = t0 + a.restart_every * self.rng.uniform(0.5, 1.5)
        next_log = t0 + 5
        while (now := time.monotonic()) < end:
            for p, _ in self.clients:
                if not p.is_alive():  # a client that ended by itself failed: replace it
                    self.clients.remove((p, _))
                    self.spawn_client()
                    break
            if self.server is not None and not self.server.alive():  # not our SIGKILL: a bug
                self.server_crashes += 1
                log(f"the server exited by itself ({self.server.proc.returncode}):\n"
                    f"{self.server.output()[-3000:]}")
                self.start_server()
            if a.kill_every and now >= next_kill:
                self.kill_client()
                next_kill = now + a.kill_every * self.rng.uniform(0.5, 1.5)
            if a.restart_every and now >= next_restart:
                self.restart_server()
                next_restart = time.monotonic() + a.restart_every * self.rng.uniform(0.5, 1.5)
            if now >= next_log:
                t = self.totals()
                log(f"{now - t0:5.0f} s: {t['requests']:,} requests, {self.kills} client kills, "
                    f"{self.restarts} server restarts, {t['verified_blocks']:,} blocks verified, "
                    f"{t['mismatches']} mismatches")
                next_log = now + 5
            time.sleep(0.02)
        elapsed = time.monotonic() - t0
        self.stop_clients.set()
        stragglers = 0
        for p, _ in self.clients:
            p.join(15)
            if p.is_alive():
                stragglers += 1
                p.kill()
                p.join()
        try:
            final = self.settle()
        except RadixKVError as e:
            log(f"final Stats failed: {e}")
            final = {}
        assert self.server is not None
        rc = self.server.stop()
        shm_left = sorted(n for n in _shm_names() - shm_before
                          if _owner_pid(n) in self.server_pids)
        t = self.totals()
        num_blocks = final.get("num_blocks", a.num_blocks)
        out: dict[str, Any] = {
            "seconds": round(elapsed, 1), "clients": a.clients, "seed": a.seed,
            "requests": t["requests"], "client_kills": self.kills,
            "client_kills_mid_lease": self.kills_mid_lease, "server_restarts": self.restarts,
            "mismatches": t["mismatches"],
            "leaked_blocks": (num_blocks - final.get("free_blocks", 0)
                              - final.get("cached_blocks", 0) + final.get("pinned_blocks", 0)),
            "leaked_leases": final.get("live_leases", -1),
            "shm_left": len(shm_left),
            "integrity": final.get("integrity", "unreachable"),
            "integrity_failures": self.integrity_failures,
            "server_crashes": self.server_crashes,
            "requests_per_s": round(t["requests"] / elapsed, 1),
            "server_exit_code": rc, "client_stragglers": stragglers,
            **{k: v for k, v in t.items() if k not in ("requests", "mismatches")},
        }
        if shm_left:
            out["shm_left_names"] = shm_left
        return out

    def settle(self) -> dict[str, Any]:
        """Wait past the lease TTL for the killed clients' leases to expire; the final Stats."""
        deadline = time.monotonic() + 2 * self.a.lease_ttl + 5
        stats: dict[str, Any] = {}
        with Client(self.socket, timeout=10.0) as kv:
            while time.monotonic() < deadline:
                stats = kv.stats()
                if not (stats["live_leases"] or stats["leased_blocks"] or stats["pinned_blocks"]):
                    break
                time.sleep(0.1)
            time.sleep(self.a.lease_ttl / 2)  # and nothing comes back
            return kv.stats(check_integrity=True)

    def cleanup(self) -> None:
        self.stop_clients.set()
        for p, _ in self.clients:
            if p.is_alive():
                p.kill()
            p.join()
        if self.server is not None and self.server.alive():
            self.server.stop()


def log(message: str) -> None:
    print(f"chaos: {message}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="A verified replay from N client processes while clients are SIGKILLed "
        "mid-lease and the server is SIGKILLed and restarted on the same socket; checks that no "
        "hit ever reads wrong bytes and nothing leaks (leases, blocks, shared memory).",
        epilog="Output (one line, or one JSON object with --json): requests (full Match..Release "
        "cycles), client_kills, server_restarts, mismatches (proven reads of wrong bytes: must "
        "be 0), leaked_blocks and leaked_leases (after the TTL: must be 0), shm_left (segments "
        "of this run's servers left after the final stop: must be 0), integrity, and the "
        "clients' counters (blocks verified, errors survived by kind, epochs noticed). Exit "
        "status 1 when any of those checks fails.")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--minutes", type=float, help="run this long")
    length.add_argument("--seconds", type=float, help="run this long (default 30)")
    p.add_argument("--clients", type=int, default=4, help="client processes (4)")
    p.add_argument("--kill-every", type=float, default=2.0, metavar="S",
                   help="SIGKILL a client about every S seconds, 0: never (2)")
    p.add_argument("--restart-every", type=float, default=5.0, metavar="S",
                   help="SIGKILL and restart the server about every S seconds, 0: never (5)")
    p.add_argument("--lease-ttl", type=float, default=2.0, help="the server's lease TTL (2 s)")
    p.add_argument("--num-blocks", type=int, default=192, help="pool blocks (192)")
    p.add_argument("--block-size", type=int, default=4, help="tokens per block (4)")
    p.add_argument("--seed", type=int, default=0, help="workload and schedule seed (0)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    a.seconds = a.minutes * 60 if a.minutes is not None else (a.seconds or 30.0)
    if a.clients < 1 or a.seconds <= 0 or a.lease_ttl <= 0:
        raise SystemExit("--clients, the duration and --lease-ttl must be positive")
    directory = tempfile.mkdtemp(prefix="rkv-chaos-")
    chaos = Chaos(a, directory)
    try:
        out = chaos.run()
    finally:
        chaos.cleanup()
        shutil.rmtree(directory, ignore_errors=True)
    emit("chaos", out, a.json)
    failed = (out["mismatches"] or out["leaked_blocks"] or out["leaked_leases"]
              or out["shm_left"] or out["integrity"] != "ok" or out["integrity_failures"]
              or out["fatal"] or out["internal_errors"] or out["server_exit_code"]
              or out["server_crashes"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
