"""`bench/chaos.py --cluster`: the chaos run over a cluster (etcd, members, a router).

    supervisor (this process)                        engine processes (spawn) x N
    etcd on loopback (temporary data directory)      Route via the router -> the verified
    members n0..n{M-1} (`serve --cluster`, token)      cycle on the chosen member
    a router (token), on a Unix socket                 (bench/_chaos_cluster_client.py); the
    every ~--kill-every s: SIGKILL an engine           router away: a member it named before
    every ~--restart-every s: SIGKILL one of a
      member (restarted on its socket: a new
      epoch), the router (restarted on its socket),
      etcd (restarted on its data directory); each
      kind once per round of three, shuffled

At the end: stop the engines; each member, past the lease TTL: no lease or block left leased or
pinned, free + cached == total, integrity ok; the router's index converges to every member's
DumpTree (state indexed, the same block count) within --converge-s seconds of the last fault,
and the time it took is reported; SIGTERM everything; no shared-memory segment of this run's
members may remain. Every piece runs with one cluster token, so the member records are signed
and every listener checks the token. With --peer-fetch the members run `serve --peer-fetch` and
the engines send half their requests to another member than the one the router names: that
member fetches the prefix from its holder (mid-fault, often), and every hit is verified the same.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from typing import Any

from _chaos_client import COUNTERS, C
from _chaos_cluster_client import cluster_client_main

from radixkv.client import Client
from radixkv.cluster.follower import snapshot_hashes
from radixkv.cluster.local import EtcdProcess, RouterProcess, free_port, start_router
from radixkv.cluster.routed import RouterClient
from radixkv.protocol.errors import RadixKVError, Unavailable
from radixkv.server.launch import ServerProcess, start_server

TOKEN = "chaos-cluster-token-0123456789"
FAULTS = ("member", "router", "etcd")


class ClusterChaos:
    def __init__(self, a: argparse.Namespace, directory: str, flags: tuple[str, ...],
                 ctx: Any, log: Any) -> None:
        self.a, self.directory, self.ctx, self.log = a, directory, ctx, log
        import random

        self.rng = random.Random(a.seed)
        self.flags = (*flags, "--cluster-ttl", "2")
        os.environ["RADIXKV_AUTH_TOKEN"] = TOKEN  # members, router, engines: one token
        self.etcd = EtcdProcess(os.path.join(directory, "etcd"), free_port(), free_port())
        os.makedirs(self.etcd.data_dir, mode=0o700)
        self.members: dict[str, ServerProcess] = {}
        self.member_pids: list[int] = []
        self.router_path = os.path.join(directory, "router.sock")
        self.router: RouterProcess | None = None
        self.stop_clients = ctx.Event()
        self.clients: list[tuple[Any, Any]] = []
        self.all_counters: list[Any] = []
        self.slot = 0
        self.kills = 0
        self.faults = {f: 0 for f in FAULTS}
        self._next_faults: list[str] = []
        self.crashes = 0

    # -- processes --

    def socket_of(self, node: str) -> str:
        return os.path.join(self.directory, f"{node}.sock")

    def start_member(self, node: str) -> None:
        for attempt in range(10):  # etcd may be restarting right now
            try:
                s = start_server(self.socket_of(node), "--cluster", self.etcd.url,
                                 "--node-id", node, *self.flags)
                self.members[node] = s
                self.member_pids.append(s.proc.pid)
                return
            except Unavailable:
                if attempt == 9:
                    raise
                time.sleep(0.5)

    def start_router(self) -> None:
        self.router = start_router(self.etcd.url, self.router_path)

    def spawn_client(self) -> None:
        counters = self.ctx.RawArray("q", len(COUNTERS))
        args = {"router": self.router_path, "block_size": self.a.block_size,
                "lease_ttl": self.a.lease_ttl, "seed": self.a.seed,
                "spread": self.a.peer_fetch}
        p = self.ctx.Process(target=cluster_client_main,
                             args=(args, self.slot, counters, self.stop_clients), daemon=True)
        self.slot += 1
        p.start()
        self.clients.append((p, counters))
        self.all_counters.append(counters)

    def kill_client(self) -> None:
        p, _ = self.clients.pop(self.rng.randrange(len(self.clients)))
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        self.kills += 1
        self.spawn_client()

    def fault(self) -> None:
        """SIGKILL a member, the router or etcd, and start it again in the same place."""
        if not self._next_faults:  # each kind once per round, in a random order
            self._next_faults = self.rng.sample(FAULTS, len(FAULTS))
        what = self._next_faults.pop()
        self.faults[what] += 1
        if what == "member":
            node = self.rng.choice(sorted(self.members))
            self.members[node].stop(signal.SIGKILL)
            self.start_member(node)
        elif what == "router":
            assert self.router is not None
            self.router.stop(signal.SIGKILL)
            self.start_router()  # on the crashed router's socket
        else:
            self.etcd.stop(signal.SIGKILL)
            time.sleep(self.rng.uniform(0.2, 1.5))
            self.etcd.start()
        self.log(f"fault: SIGKILL {what}, restarted")

    def totals(self) -> dict[str, int]:
        return {name: sum(int(c[i]) for c in self.all_counters)
                for name, i in C.items() if name != "in_lease"}

    # -- the run --

    def run(self) -> dict[str, Any]:
        a = self.a
        self.etcd.start()
        for i in range(a.members):
            self.start_member(f"n{i}")
        self.start_router()
        with RouterClient(self.router_path) as rc:
            rc.wait_members(a.members)
        for _ in range(a.clients):
            self.spawn_client()
        t0 = time.monotonic()
        end = t0 + a.seconds
        next_kill = t0 + a.kill_every * self.rng.uniform(0.5, 1.5)
        next_fault = t0 + a.restart_every * self.rng.uniform(0.5, 1.5)
        next_log = t0 + 5
        while (now := time.monotonic()) < end:
            for p, c in self.clients:
                if not p.is_alive():
                    self.clients.remove((p, c))
                    self.spawn_client()
                    break
            for node, s in list(self.members.items()):
                if not s.alive():  # not our SIGKILL: a bug
                    self.crashes += 1
                    self.log(f"member {node} exited by itself:\n{s.output()[-3000:]}")
                    self.start_member(node)
            if a.kill_every and now >= next_kill:
                self.kill_client()
                next_kill = now + a.kill_every * self.rng.uniform(0.5, 1.5)
            if a.restart_every and now >= next_fault:
                self.fault()
                next_fault = time.monotonic() + a.restart_every * self.rng.uniform(0.5, 1.5)
            if now >= next_log:
                t = self.totals()
                self.log(f"{now - t0:5.0f} s: {t['requests']:,} requests ({t['routed']:,} "
                         f"routed, {t['router_fallbacks']:,} without the router), faults "
                         f"{self.faults}, {t['verified_blocks']:,} blocks verified, "
                         f"{t['mismatches']} mismatches")
                next_log = now + 5
            time.sleep(0.02)
        elapsed = time.monotonic() - t0
        self.stop_clients.set()
        for p, _ in self.clients:
            p.join(15)
            if p.is_alive():
                p.kill()
                p.join()
        finals = {node: self.settle(s.socket) for node, s in self.members.items()}
        converge_s = self.converge()
        t = self.totals()
        leaked_blocks = sum(f.get("num_blocks", 0) - f.get("free_blocks", 0)
                            - f.get("cached_blocks", 0) + f.get("pinned_blocks", 0)
                            for f in finals.values())
        return {
            "seconds": round(elapsed, 1), "clients": a.clients, "members": a.members,
            "seed": a.seed, "requests": t["requests"], "client_kills": self.kills,
            "member_kills": self.faults["member"], "router_kills": self.faults["router"],
            "etcd_kills": self.faults["etcd"], "mismatches": t["mismatches"],
            "leaked_blocks": leaked_blocks,
            "leaked_leases": sum(f.get("live_leases", -1) for f in finals.values()),
            "integrity": ("ok" if all(f.get("integrity") == "ok" for f in finals.values())
                          else "failed"),
            "converged": converge_s is not None,
            "converge_s": round(converge_s, 2) if converge_s is not None else None,
            "member_crashes": self.crashes,
            "peer_fetched_blocks": sum(p.get("blocks_in", 0) for f in finals.values()
                                       for p in f.get("peers", [])),
            "requests_per_s": round(t["requests"] / elapsed, 1),
            **{k: v for k, v in t.items() if k not in ("requests", "mismatches")},
        }

    def settle(self, socket: str) -> dict[str, Any]:
        """Past the lease TTL, one member's final Stats (integrity checked)."""
        deadline = time.monotonic() + 2 * self.a.lease_ttl + 5
        try:
            with Client(socket, timeout=10.0) as kv:
                while time.monotonic() < deadline:
                    st = kv.stats()
                    if not (st["live_leases"] or st["leased_blocks"] or st["pinned_blocks"]):
                        break
                    time.sleep(0.1)
                time.sleep(self.a.lease_ttl / 2)
                return dict(kv.stats(check_integrity=True))
        except RadixKVError as e:
            self.log(f"final Stats of {socket} failed: {e}")
            return {}

    def converge(self) -> float | None:
        """Seconds until the router's index holds, for every member, exactly the blocks of its
        DumpTree (None if not within --converge-s)."""
        t0 = time.monotonic()
        with RouterClient(self.router_path) as rc:
            while time.monotonic() - t0 < self.a.converge_s:
                try:
                    if self.index_agrees(rc):
                        return time.monotonic() - t0
                except RadixKVError:
                    pass
                time.sleep(0.1)
        return None

    def index_agrees(self, rc: RouterClient) -> bool:
        status = {m["node_id"]: m for m in rc.members()["members"]}
        for node, s in self.members.items():
            with Client(s.socket, timeout=10.0) as kv:
                st = kv.stats()
                block_size = int(st["layout"]["block_size"])
                want = sum(len(snapshot_hashes(ns["namespace"],
                                               kv.dump_tree(ns["namespace"])[0], block_size))
                           for ns in st["namespaces"])
            m = status.get(node)
            if m is None or m["state"] != "indexed" or m["indexed_blocks"] != want:
                return False
        return True

    def cleanup(self) -> tuple[int, list[int]]:
        """Stop everything; (the worst member exit code, this run's member pids)."""
        self.stop_clients.set()
        for p, _ in self.clients:
            if p.is_alive():
                p.kill()
            p.join()
        codes = [s.stop() for s in self.members.values()]
        if self.router is not None:
            codes.append(self.router.stop())
        self.etcd.stop()
        os.environ.pop("RADIXKV_AUTH_TOKEN", None)
        return max(codes or [0]), self.member_pids


def summary_ok(out: dict[str, Any]) -> bool:
    return not (out["mismatches"] or out["leaked_blocks"] or out["leaked_leases"]
                or out["integrity"] != "ok" or not out["converged"] or out["fatal"]
                or out["internal_errors"] or out["member_crashes"] or out["exit_code"]
                or out["shm_left"])


def dump(out: dict[str, Any]) -> str:
    return json.dumps(out, indent=1)
