"""The cluster as a hostile local user would try it: the router's token, TLS and socket
directory, a router restarting on its crashed socket, records planted in etcd, etcd's own auth
and TLS, and a second member with a taken node id. A real etcd on loopback, members and
routers in subprocesses."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from _server import BLOCK_SIZE, wait_for

from radixkv.client import Client
from radixkv.cluster.local import etcd_process, local_cluster, start_router
from radixkv.cluster.routed import RouterClient
from radixkv.protocol import errors
from radixkv.rpc.etcd import Etcd, EtcdTarget
from radixkv.server.launch import start_server, wait_for_banner

TOKEN = "cluster-token-0123456789"
NS = "chat@rev1"


def prompt(head: int, blocks: int = 3) -> list[int]:
    return [head * 1000 + i for i in range(blocks * BLOCK_SIZE)]


def store(kv: Client, tokens: list[int]) -> None:
    with kv.lease(NS, tokens) as lease:
        lease.insert(tokens, lease.block_ids + lease.new_block_ids, release=True)


def router_process(etcd_url: str, listen: str, *extra: str, env=None, timeout: float = 60):
    """`radixkv router` with extra flags; (process, banner line or None, output lines)."""
    proc = subprocess.Popen([sys.executable, "-m", "radixkv", "router", "--etcd", etcd_url,
                             "--listen", listen, "--log-level", "warning", "--exit-with-parent",
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    lines, banner = wait_for_banner(proc, "radixkv router on", timeout)
    return proc, banner, lines


def stop(proc) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def member_states(rc) -> dict[str, str]:
    return {m["node_id"]: m["state"] for m in rc.members()["members"]}


# ---- the router's listener ---------------------------------------------------------------------


def test_the_router_needs_the_cluster_token(flags, monkeypatch):
    monkeypatch.setenv("RADIXKV_AUTH_TOKEN", TOKEN)  # members, router and its followers
    with local_cluster(1, *flags) as c:
        monkeypatch.delenv("RADIXKV_AUTH_TOKEN")
        with Client(c.members["n0"].socket, token=TOKEN) as kv:
            store(kv, prompt(1))
        with RouterClient(c.router) as anonymous:  # a local user guessing prompts
            with pytest.raises(errors.Unauthenticated):
                anonymous.route(NS, prompt(1), probe=True)
            with pytest.raises(errors.Unauthenticated):
                anonymous.members()
        with RouterClient(c.router, token=TOKEN) as rc:
            rc.wait_members(1)
            wait_for(lambda: rc.route(NS, prompt(1), probe=True).members[0].cached_tokens == 12,
                     what="n0 indexed")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_the_router_serves_tls_with_the_token(flags, monkeypatch, tmp_path):
    cert, key = make_cert(tmp_path)
    monkeypatch.setenv("RADIXKV_AUTH_TOKEN", TOKEN)
    with local_cluster(1, *flags, router=False) as c:
        proc, banner, lines = router_process(c.etcd.url, "127.0.0.1:0", "--tls-cert", cert,
                                             "--tls-key", key)
        try:
            assert banner is not None, "".join(lines)
            port = re.search(r"127\.0\.0\.1:(\d+)", banner).group(1)
            with RouterClient(f"localhost:{port}", token=TOKEN, tls_ca=cert) as rc:
                rc.wait_members(1)
            with RouterClient(f"localhost:{port}", token=TOKEN, timeout=3) as plaintext:
                with pytest.raises(errors.Unavailable):
                    plaintext.members()
        finally:
            stop(proc)


def test_router_tcp_needs_a_token_or_insecure(flags):
    with etcd_process() as etcd:
        proc, banner, lines = router_process(etcd.url, "127.0.0.1:0")
        stop(proc)
        assert banner is None and proc.returncode == 2
        assert "--insecure" in "".join(lines)
        proc, banner, lines = router_process(etcd.url, "127.0.0.1:0", "--insecure")
        try:
            assert banner is not None and "INSECURE" in "".join(lines)
        finally:
            stop(proc)


def test_the_router_socket_directory_is_checked_on_both_sides(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # as another local user could have prepared it
    with etcd_process() as etcd:
        proc, banner, lines = router_process(etcd.url, str(shared / "router.sock"))
        stop(proc)
        assert banner is None and proc.returncode == 2, "".join(lines)
        assert "not writable by group or others" in "".join(lines)
    with pytest.raises(errors.PermissionDenied, match="not writable by group or others"):
        RouterClient(str(shared / "router.sock"))


def test_a_crashed_router_restarts_on_its_socket(flags):
    with local_cluster(1, *flags, router=False) as c:
        path = os.path.join(c.directory, "r.sock")
        first = start_router(c.etcd.url, path)
        proc, banner, lines = router_process(c.etcd.url, path)  # a second one: refused
        stop(proc)
        assert banner is None and "another radixkv router holds" in "".join(lines)
        first.stop(signal.SIGKILL)
        assert os.path.exists(path)  # the crashed router's socket is left behind
        again = start_router(c.etcd.url, path)
        try:
            with RouterClient(again.address) as rc:
                rc.wait_members(1)
        finally:
            assert again.stop() == 0
        assert not os.path.exists(path) and not os.path.exists(path + ".lock")


# ---- the Events stream a follower depends on ---------------------------------------------------


def test_a_member_is_indexed_only_once_its_events_stream_runs(flags, monkeypatch):
    monkeypatch.setenv("RADIXKV_AUTH_TOKEN", TOKEN)
    with local_cluster(1, *flags, "--stream-workers", "2", router=False) as c:
        with Client(c.members["n0"].socket, token=TOKEN) as kv:
            store(kv, prompt(1))
            held = [kv.events(from_sequence=1, timeout=30) for _ in range(2)]
            for it in held:  # both of the member's stream threads are taken
                assert next(it).WhichOneof("kind") == "stored"
            c.start_router()
            with RouterClient(c.router) as rc:  # the token from the environment
                wait_for(lambda: "n0" in member_states(rc), what="n0 listed")
                for _ in range(20):
                    assert member_states(rc)["n0"] != "indexed"
                    time.sleep(0.1)
                with pytest.raises(errors.Unavailable, match="no member to route to"):
                    rc.route(NS, prompt(1), probe=True)
                for it in held:
                    it.close()
                rc.wait_members(1)
                wait_for(lambda: rc.route(NS, prompt(1), probe=True).members[0].cached_tokens
                         == 12, what="n0 routed")


# ---- what etcd holds ---------------------------------------------------------------------------


class Recorder(grpc.GenericRpcHandler):
    """A stand-in service that records the metadata of every call it gets."""

    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []

    def service(self, details):
        self.seen.append(dict(details.invocation_metadata or ()))
        return None


def test_a_record_planted_in_etcd_gets_no_token(flags, monkeypatch, tmp_path):
    monkeypatch.setenv("RADIXKV_AUTH_TOKEN", TOKEN)
    with local_cluster(1, *flags) as c:
        monkeypatch.delenv("RADIXKV_AUTH_TOKEN")
        recorder = Recorder()
        fake = grpc.server(ThreadPoolExecutor(2), handlers=[recorder])
        fake_path = os.path.join(c.directory, "fake.sock")
        fake.add_insecure_port(f"unix://{fake_path}")
        fake.start()
        try:
            target = EtcdTarget.parse(c.etcd.url)
            etcd = Etcd(target)
            real = json.loads(etcd.get(target.members_prefix + b"n0"))
            planted = dict(real, node_id="evil", address=f"unix://{fake_path}")
            etcd.put(target.members_prefix + b"evil", json.dumps(planted).encode())
            moved = dict(real, node_id="n9", address=f"unix://{fake_path}")
            moved.pop("signature", None)
            etcd.put(target.members_prefix + b"n9", json.dumps(moved).encode())
            etcd.close()
            time.sleep(3)
            assert not any("authorization" in m for m in recorder.seen), recorder.seen
            with RouterClient(c.router, token=TOKEN) as rc:
                assert set(member_states(rc)) == {"n0"}
            assert "ignoring member" in c.routers[0].output()
        finally:
            fake.stop(0)


def start_etcd_tls_auth(directory: str, cert: str, key: str, client_certs: bool = False):
    """etcd on loopback with TLS on its client port and auth on: user radixkv (password
    'radixkv-pass') may read and write /radixkv/ only. `client_certs`: instead of auth,
    etcd requires a client certificate signed by `cert`."""
    from radixkv.cluster.local import etcd_binary, free_port

    client, peer = free_port(), free_port()
    log = open(os.path.join(directory, "etcd.log"), "ab")  # noqa: SIM115
    proc = subprocess.Popen(
        [etcd_binary(), "--name", "s", "--data-dir", os.path.join(directory, "data"),
         "--listen-client-urls", f"https://127.0.0.1:{client}",
         "--advertise-client-urls", f"https://127.0.0.1:{client}",
         "--cert-file", cert, "--key-file", key,
         *(["--client-cert-auth", "--trusted-ca-file", cert] if client_certs else []),
         "--listen-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"s=http://127.0.0.1:{peer}"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    log.close()
    ctl = ["etcdctl", f"--endpoints=https://127.0.0.1:{client}", f"--cacert={cert}",
           *([f"--cert={cert}", f"--key={key}"] if client_certs else [])]
    wait_for(lambda: subprocess.run([*ctl, "endpoint", "health"], capture_output=True)
             .returncode == 0, timeout=30, what="etcd")
    if client_certs:
        return proc, f"etcd://127.0.0.1:{client}"
    for args in (["user", "add", "root:root-pass"], ["user", "add", "radixkv:radixkv-pass"],
                 ["role", "add", "rkv"],
                 ["role", "grant-permission", "rkv", "--prefix=true", "readwrite", "/radixkv/"],
                 ["user", "grant-role", "radixkv", "rkv"], ["auth", "enable"]):
        subprocess.run([*ctl, *args], check=True, capture_output=True)
    return proc, f"etcd://127.0.0.1:{client}"


def make_cert(tmp_path) -> tuple[str, str]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return str(cert), str(key)


@pytest.mark.skipif(shutil.which("openssl") is None or shutil.which("etcdctl") is None,
                    reason="needs openssl and etcdctl")
def test_members_and_routers_use_etcd_tls_and_auth(flags, tmp_path, monkeypatch):
    cert, key = make_cert(tmp_path)
    password = tmp_path / "etcd-password"
    password.write_text("radixkv-pass\n")
    etcd_dir = tempfile.mkdtemp(prefix="rkv-e-")
    proc, url = start_etcd_tls_auth(etcd_dir, cert, key)
    creds = ("--etcd-ca", cert, "--etcd-user", "radixkv", "--etcd-password-file", str(password))
    monkeypatch.setenv("RADIXKV_AUTH_TOKEN", TOKEN)
    sock = os.path.join(etcd_dir, "n0.sock")
    try:
        # without the password: refused by etcd, exit 2, nothing left behind
        with pytest.raises(errors.Unavailable, match="exited 2"):
            start_server(sock, "--cluster", url, "--node-id", "n0", "--etcd-ca", cert, *flags)
        member = start_server(sock, "--cluster", url, "--node-id", "n0", *creds, *flags)
        router, banner, lines = router_process(url, os.path.join(etcd_dir, "r.sock"), *creds)
        try:
            assert banner is not None, "".join(lines)
            with RouterClient(os.path.join(etcd_dir, "r.sock"), token=TOKEN) as rc:
                rc.wait_members(1)
        finally:
            stop(router)
            assert member.stop() == 0
    finally:
        proc.terminate()
        proc.wait(15)
        shutil.rmtree(etcd_dir, ignore_errors=True)


@pytest.mark.skipif(shutil.which("openssl") is None or shutil.which("etcdctl") is None,
                    reason="needs openssl and etcdctl")
def test_members_present_a_client_certificate_to_etcd(flags, tmp_path):
    cert, key = make_cert(tmp_path)  # self-signed: the CA of etcd's server and client certs
    etcd_dir = tempfile.mkdtemp(prefix="rkv-e-")
    proc, url = start_etcd_tls_auth(etcd_dir, cert, key, client_certs=True)
    sock = os.path.join(etcd_dir, "n0.sock")
    try:
        with pytest.raises(errors.Unavailable, match="exited 2"):  # TLS, but no certificate
            start_server(sock, "--cluster", url, "--node-id", "n0", "--etcd-ca", cert, *flags)
        member = start_server(sock, "--cluster", url, "--node-id", "n0", "--etcd-ca", cert,
                              "--etcd-cert", cert, "--etcd-key", key, *flags)
        assert member.stop() == 0
    finally:
        proc.terminate()
        proc.wait(15)
        shutil.rmtree(etcd_dir, ignore_errors=True)


def test_a_second_member_with_a_taken_node_id_is_refused(flags):
    with local_cluster(1, *flags) as c:
        other = os.path.join(c.directory, "other.sock")
        with pytest.raises(errors.Unavailable, match="exited 2") as e:
            server = start_server(other, "--cluster", c.etcd.url, "--node-id", "n0", *flags)
            server.stop()
        assert "node id n0 is held by" in str(e.value) and c.socket_of("n0") in str(e.value)
        assert not os.path.exists(other)
        # advertising the holder's own address proves nothing: refused too
        with pytest.raises(errors.Unavailable, match="node id n0 is held by"):
            server = start_server(other, "--cluster", c.etcd.url, "--node-id", "n0",
                                  "--advertise", f"unix://{c.socket_of('n0')}", *flags)
            server.stop()
        with RouterClient(c.router) as rc:  # the first one still serves and is routed to
            rc.wait_members(1)
            assert rc.route(NS, prompt(1), probe=True).members[0].node_id == "n0"
        # a crashed member restarting on its own address takes its id back at once
        c.members["n0"].stop(signal.SIGKILL)
        c.start_member("n0")
        with RouterClient(c.router) as rc:
            wait_for(lambda: member_states(rc).get("n0") == "indexed", what="n0 back")
