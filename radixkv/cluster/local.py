"""A cluster on this machine, for tools and tests: etcd on loopback with a temporary data
directory, N `radixkv serve --cluster` members on temporary Unix sockets, and a router.

    with local_cluster(3, "--num-blocks", "64") as c:   # etcd + 3 members + router
        RoutedClient(c.router) ...
        c.members["n1"].stop(signal.SIGKILL)            # a crash

Everything is stopped with SIGTERM at exit and its directories removed; nothing is left behind.
etcd must be installed (`etcd` on PATH: Debian's etcd-server); EtcdNotFound says so otherwise.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from radixkv.cluster.router_server import BANNER as ROUTER_BANNER
from radixkv.protocol.errors import RadixKVError, Unavailable
from radixkv.rpc.etcd import Etcd, EtcdTarget
from radixkv.server.launch import ServerProcess, start_server, stop_process, wait_for_banner


class EtcdNotFound(RadixKVError):
    code = "FAILED_PRECONDITION"


PORT_TRIES = 3  # etcd starts on fresh ports again when another process took one meanwhile


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def etcd_binary() -> str:
    path = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else "")
    if not path:
        raise EtcdNotFound("etcd is not installed: `apt-get install etcd-server` (Debian; "
                           "scripts/bootstrap --tests does it)")
    return path


@dataclass
class EtcdProcess:
    """One throwaway etcd member on loopback; `restart()` keeps its data directory and ports."""

    data_dir: str
    client_port: int
    peer_port: int
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"etcd://127.0.0.1:{self.client_port}"

    def start(self, timeout: float = 30.0) -> None:
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        log = open(os.path.join(self.data_dir, "etcd.log"), "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [etcd_binary(), "--name", "radixkv", "--data-dir",
             os.path.join(self.data_dir, "data"), "--listen-client-urls", client,
             "--advertise-client-urls", client, "--listen-peer-urls", peer,
             "--initial-advertise-peer-urls", peer, "--initial-cluster", f"radixkv={peer}"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        etcd = Etcd(EtcdTarget.parse(self.url), timeout=1.0)
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    etcd.get(b"/radixkv/ready")
                    return
                except Unavailable:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        self.stop()
                        raise Unavailable("etcd did not start:\n" + self.log()[-2000:]) from None
                    time.sleep(0.1)
        finally:
            etcd.close()

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def restart(self, wipe: bool = False) -> None:
        """Stop and start again on the same ports; `wipe`: with an empty data directory (etcd
        forgets every key and lease, as a rebuilt etcd would)."""
        self.stop()
        if wipe:
            shutil.rmtree(os.path.join(self.data_dir, "data"), ignore_errors=True)
        self.start()

    def log(self) -> str:
        with open(os.path.join(self.data_dir, "etcd.log"), "rb") as f:
            return f.read().decode(errors="replace")


@contextlib.contextmanager
def etcd_process() -> Iterator[EtcdProcess]:
    """etcd on free loopback ports with a temporary data directory; removed at exit."""
    directory = tempfile.mkdtemp(prefix="rkv-etcd-")
    e: EtcdProcess | None = None
    try:
        for attempt in range(PORT_TRIES):  # a free port can be taken before etcd binds it
            e = EtcdProcess(os.path.join(directory, str(attempt)), free_port(), free_port())
            os.mkdir(e.data_dir, 0o700)
            try:
                e.start()
                break
            except Unavailable as err:
                if "address already in use" not in str(err) or attempt == PORT_TRIES - 1:
                    raise
        assert e is not None
        yield e
    finally:
        if e is not None:
            e.stop()
        shutil.rmtree(directory, ignore_errors=True)


@dataclass
class RouterProcess:
    proc: subprocess.Popen[str]
    address: str
    lines: list[str] = field(default_factory=list)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        return stop_process(self.proc, sig)

    def output(self) -> str:
        return "".join(self.lines)


def start_router(etcd_url: str, listen: str, timeout: float = 60.0) -> RouterProcess:
    """`python -m radixkv router` in a subprocess; returns once it listens."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixkv", "router", "--etcd", etcd_url, "--listen", listen,
         "--log-level", "warning", "--exit-with-parent"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, banner = wait_for_banner(proc, ROUTER_BANNER, timeout)
    if banner is None:
        raise Unavailable(f"radixkv router exited {proc.returncode} before serving:\n"
                          + "".join(lines))
    address = banner[len(ROUTER_BANNER):].split()[0].rstrip(":,")
    return RouterProcess(proc, address, lines)


@dataclass
class LocalCluster:
    etcd: EtcdProcess
    directory: str
    flags: tuple[str, ...]
    members: dict[str, ServerProcess] = field(default_factory=dict)
    router: str = ""
    routers: list[RouterProcess] = field(default_factory=list)

    def socket_of(self, node_id: str) -> str:
        return os.path.join(self.directory, f"{node_id}.sock")

    def start_member(self, node_id: str, *extra: str) -> ServerProcess:
        """Start (or restart, on the same socket) member `node_id`."""
        server = start_server(self.socket_of(node_id), "--cluster", self.etcd.url,
                              "--node-id", node_id, *self.flags, *extra)
        self.members[node_id] = server
        return server

    def start_router(self) -> RouterProcess:
        r = start_router(self.etcd.url,
                         os.path.join(self.directory, f"router{len(self.routers)}.sock"))
        self.routers.append(r)
        self.router = self.router or r.address
        return r


@contextlib.contextmanager
def local_cluster(nodes: int, *server_flags: str, cluster_ttl: int = 2,
                  router: bool = True) -> Iterator[LocalCluster]:
    """etcd + members n0..n{nodes-1} (`radixkv serve SERVER_FLAGS --cluster ... --cluster-ttl
    TTL`) + a router (if `router`); all stopped (SIGTERM) and removed at exit."""
    directory = tempfile.mkdtemp(prefix="rkv-c-")  # short: socket paths are limited
    try:
        with etcd_process() as etcd:
            c = LocalCluster(etcd, directory,
                             (*server_flags, "--cluster-ttl", str(cluster_ttl)))
            try:
                for i in range(nodes):
                    c.start_member(f"n{i}")
                if router:
                    c.start_router()
                yield c
            finally:
                for r in c.routers:
                    r.stop()
                for m in c.members.values():
                    m.stop()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
