"""Chaos: a verified replay while clients and the server are SIGKILLed and the server restarts.

    python bench/chaos.py --minutes 10 [--clients 4] [--json]
    python bench/chaos.py --seconds 30 --clients 3 --disk-blocks 96 --json   # what CI runs
    python bench/chaos.py --cluster --members 3 --minutes 10 --json  # etcd, members, a router
    python bench/chaos.py --cluster --peer-fetch --seconds 30 --json  # ... members fetching

    supervisor (this process)                      client processes (spawn) x N
    start_server(socket) ---------------------->   Match -> read the hit blocks, check their keys
    every ~--kill-every s: SIGKILL a client that   -> Allocate the rest -> write their keys
      holds a lease, spawn a replacement           -> Insert -> Release, in a loop; on Unavailable
    every ~--restart-every s: Stats integrity        retry (a new Client after 2 s down);
      check, SIGKILL the server, start_server        answers that crossed a pool epoch change
      again on the same socket (new epoch)           are discarded, not trusted
    at the end: stop the clients, wait past the lease TTL, Stats: no lease and no block may be
    left leased or pinned, free + cached == total, integrity ok; SIGTERM the server; no
    shared-memory segment of any server this run started may remain.

Every full block's first 8 bytes are its key: a chained hash of namespace + token prefix
(radixkv.replay.client.block_keys, written and read with its BlockBytes), so a hit block holding
anything but its own prefix's bytes is a mismatch. bench/_chaos_client.py is the client process:
when a read counts as proven, and why answers that crossed an epoch change are discarded.

--disk-blocks N gives the server a disk tier of N slots (--disk-dir in the run's directory): the
pool's evictions are demoted, hits past the pool are promoted and verified the same way, and every
SIGKILL is followed by a restart that rescans the slot file.

--cluster runs the same engines' cycle over a cluster instead (bench/chaos_cluster.py): they
route through a router while members, the router and etcd are SIGKILLed and restarted.

Prints progress on stderr, one summary line (or JSON with --json) on stdout; exit status 1 on a
mismatch, a leak, a failed integrity check, a left segment or an unexpected client error.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _chaos_client import COUNTERS, C, client_main  # noqa: E402
from _common import emit  # noqa: E402

from radixkv.client.client import Client  # noqa: E402
from radixkv.protocol.errors import RadixKVError, Unavailable  # noqa: E402
from radixkv.server.launch import ServerProcess, start_server  # noqa: E402

# 2 layers x 2 kv heads x head_dim 8, fp32: 1 KiB per 4-token block
LAYOUT = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "hidden_size": 32, "torch_dtype": "float32"}
SHM_DIR = "/dev/shm"


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
        if a.disk_blocks:
            disk = os.path.join(directory, "disk")
            os.mkdir(disk, 0o700)
            self.flags += ("--disk-dir", disk, "--disk-capacity-blocks", str(a.disk_blocks))
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
        self.disk_earlier: dict[str, int] = {}  # the disk counters of the servers restarted so far

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
                stats = kv.stats(check_integrity=True)
            integrity = stats["integrity"]
            for name, n in _disk_figures(stats.get("disk")).items():
                self.disk_earlier[name] = self.disk_earlier.get(name, 0) + n
            if integrity != "ok":
                self.integrity_failures += 1
                log(f"integrity check failed before restart {self.restarts + 1}: {integrity}")
        except RadixKVError as e:
            log(f"Stats before restart {self.restarts + 1} failed: {e}")
        self.server.stop(signal.SIGKILL)
        self.start_server()
        self.restarts += 1

    def disk_totals(self, disk: dict[str, Any] | None) -> dict[str, int]:
        """The disk counters summed over every server lifetime (each restart starts them at 0)."""
        last = _disk_figures(disk)
        return {name: self.disk_earlier.get(name, 0) + last.get(name, 0)
                for name in {*self.disk_earlier, *last}}

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
            **self.disk_totals(final.get("disk")),
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


def _disk_figures(disk: dict[str, Any] | None) -> dict[str, Any]:
    """The disk tier's counters from the final Stats (none without a tier)."""
    if not disk or not disk.get("capacity_blocks"):
        return {}
    names = ("demoted_blocks", "promoted_blocks", "evicted_blocks", "verify_failures",
             "loaded_blocks", "dropped_at_load", "hit_tokens")
    return {f"disk_{n}": disk[n] for n in names if n in disk}


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
    p.add_argument("--disk-blocks", type=int, default=0, metavar="N",
                   help="give the server a disk tier of N slots below the pool (0: none)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    g = p.add_argument_group("cluster (bench/chaos_cluster.py)")
    g.add_argument("--cluster", action="store_true",
                   help="etcd + --members members + a router; the faults (every "
                   "--restart-every s) are SIGKILLs of a member, the router or etcd")
    g.add_argument("--members", type=int, default=3, help="cluster members (3)")
    g.add_argument("--peer-fetch", action="store_true",
                   help="members run --peer-fetch (from 1 block) and engines send half their "
                   "requests to another member than the router names, which then fetches")
    g.add_argument("--converge-s", type=float, default=20.0, metavar="S",
                   help="the router's index must match every member's DumpTree within S "
                   "seconds of the end (20)")
    return p


def run_cluster(a: argparse.Namespace, directory: str) -> tuple[dict[str, Any], bool]:
    from chaos_cluster import ClusterChaos, summary_ok

    config = os.path.join(directory, "config.json")
    with open(config, "w") as f:
        json.dump(LAYOUT, f)
    flags = ("--model-config", config, "--block-size", str(a.block_size),
             "--num-blocks", str(a.num_blocks), "--lease-ttl", str(a.lease_ttl))
    if a.peer_fetch:
        flags = (*flags, "--peer-fetch", "--peer-fetch-min-blocks", "1")
    shm_before = _shm_names()
    chaos = ClusterChaos(a, directory, flags, mp.get_context("spawn"), log)
    try:
        out = chaos.run()
    finally:
        code, pids = chaos.cleanup()
    out["exit_code"] = code
    out["shm_left"] = len([n for n in _shm_names() - shm_before if _owner_pid(n) in pids])
    return out, summary_ok(out)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    a.seconds = a.minutes * 60 if a.minutes is not None else (a.seconds or 30.0)
    if a.clients < 1 or a.seconds <= 0 or a.lease_ttl <= 0:
        raise SystemExit("--clients, the duration and --lease-ttl must be positive")
    directory = tempfile.mkdtemp(prefix="rkv-chaos-")
    if a.cluster:
        if a.members < 1:
            raise SystemExit("--members must be positive")
        try:
            out, ok = run_cluster(a, directory)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        emit("chaos-cluster", out, a.json)
        return 0 if ok else 1
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
