"""TLS on the TCP port and the bearer token, against a real server; the Unix socket's directory
and lock file, which another local user must not be able to prepare."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest
from _server import TOKEN, running_server, tiny_config_path

from radixkv.client import Client
from radixkv.protocol import errors


def test_token_is_required_on_radixkv_calls_but_not_on_health(token_file):
    with running_server("--auth-token-file", token_file) as s:
        with Client(s.socket) as anonymous:
            assert anonymous.health() == "SERVING"  # load balancers probe without a token
            with pytest.raises(errors.Unauthenticated, match="auth token"):
                anonymous.pool_info()
            with pytest.raises(errors.Unauthenticated):
                list(anonymous.events(from_sequence=1, timeout=1))
        with Client(s.socket, token="wrong-token-0123456789") as wrong:
            with pytest.raises(errors.Unauthenticated):
                wrong.match("ns", [1, 2, 3, 4])
        with Client(s.socket, token=TOKEN) as kv:
            m = kv.match("ns", [1, 2, 3, 4])
            kv.release(m.lease_id)
            assert kv.stats(check_integrity=True)["integrity"] == "ok"


def test_short_token_is_refused(tmp_path):
    path = tmp_path / "token"
    path.write_text("short\n")
    with pytest.raises(errors.Unavailable, match="use at least 16"):
        with running_server("--auth-token-file", str(path)):
            pass


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls_on_tcp(tmp_path, token_file):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    with running_server("--tcp", "127.0.0.1:0", "--tls-cert", str(cert), "--tls-key", str(key),
                        "--auth-token-file", token_file) as s:
        port = re.search(r"127\.0\.0\.1:(\d+)", s.banner).group(1)
        with Client(f"localhost:{port}", tls_ca=str(cert), token=TOKEN, timeout=10) as kv:
            assert kv.pool_info().layout.block_size == 4
        with Client(f"localhost:{port}", token=TOKEN, timeout=3) as plaintext:
            with pytest.raises(errors.Unavailable):
                plaintext.pool_info()


# ---- the Unix socket ---------------------------------------------------------------------------


def test_socket_directory_of_another_mode_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # as another local user could have prepared it
    with pytest.raises(errors.PermissionDenied, match="not writable by group or others"):
        Client(str(shared / "radixkv.sock"))
    out = subprocess.run([sys.executable, "-m", "radixkv", "serve", "--socket",
                          str(shared / "radixkv.sock"), "--model-config",
                          tiny_config_path(str(tmp_path))],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "not writable by group or others" in out.stderr

def test_lock_file_symlink_is_not_followed(tmp_path):
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (d / "s.sock.lock").symlink_to(victim)
    out = subprocess.run([sys.executable, "-m", "radixkv", "serve", "--socket",
                          str(d / "s.sock"), "--model-config", tiny_config_path(str(tmp_path))],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "lock file" in out.stderr
    assert victim.read_text() == "keep me"
