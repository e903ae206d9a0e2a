"""Bad input and limits: namespace names, the leases one client may hold, the namespaces the
service keeps, batch sizes and the integrity-check rate, and the server's flags (checked at
parse time, before anything starts)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from _kv import make_service, toks
from _server import running_server

from radixkv.client import Client
from radixkv.protocol import errors


@pytest.mark.parametrize("name", ["with space", "tab\there", "nl\n", "\x1b[31mred", "ünï",
                                  "x" * 257, ""])
def test_namespace_names_are_printable_ascii(svc, name):
    with pytest.raises(errors.InvalidArgument):
        svc.match("e", name, toks(1))

def test_leases_per_client_are_capped(clock):
    svc = make_service(clock, max_leases_per_client=3)
    held = [svc.match("greedy", "ns", toks(1)).lease_id for _ in range(3)]
    with pytest.raises(errors.LimitExceeded, match="holds 3 live leases"):
        svc.match_many("greedy", [("ns", toks(1))])
    with pytest.raises(errors.LimitExceeded):
        svc.allocate("greedy", None, "ns", 1)
    svc.release("other", [svc.match("other", "ns", toks(1)).lease_id])  # others unaffected
    svc.release("greedy", held)

def test_batch_sizes_and_integrity_rate_are_capped():
    with running_server() as s, Client(s.socket) as kv:
        assert kv.pool_info().max_batch == 4096
        with pytest.raises(errors.InvalidArgument, match="4097 in one call, limit 4096"):
            kv.match_many([("ns", [1])] * 4097)
        with pytest.raises(errors.InvalidArgument, match="limit 4096"):
            kv.release(*range(1, 4098))
        assert kv.stats()["live_leases"] == 0
        results = []
        for _ in range(50):  # back to back: never an error, at most a short wait
            results.append(kv.stats(check_integrity=True)["integrity"])
        assert set(results) == {"ok"}

@pytest.mark.parametrize("flag,value,message", [
    ("--policy", "nope", "invalid choice: 'nope'"),
    ("--lease-ttl", "0", "must be a positive number"),
    ("--workers", "0", "must be a positive integer"),
    ("--max-tokens", "-5", "must be a positive integer"),
])
def test_flags_are_checked_at_parse_time(tmp_path, flag, value, message):
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "radixkv", "serve", "--socket",
                          str(tmp_path / "s.sock"), flag, value],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert not (tmp_path / "s.sock").exists()
    assert time.monotonic() - start < 30
