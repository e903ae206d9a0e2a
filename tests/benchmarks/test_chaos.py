"""bench/chaos.py, CI-sized: 15 s (120 s in the thorough profile) of verified replay from 3
client processes while clients are SIGKILLed mid-lease and the server (with a disk tier below its
pool) is SIGKILLed and restarted on the same socket; and 5 s more of its cluster mode (etcd,
2 members, a router; members, the router and etcd SIGKILLed), with and without peer fetch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CHAOS = Path(__file__).resolve().parents[2] / "bench" / "chaos.py"

# CI-sized runs; the thorough profile soaks (HYPOTHESIS_PROFILE=thorough)
SECONDS = 120 if os.environ.get("HYPOTHESIS_PROFILE") == "thorough" else 15

pytestmark = [pytest.mark.slow, pytest.mark.timeout(SECONDS + 150)]


def run_chaos(timeout: float, *flags: str) -> tuple[subprocess.CompletedProcess, dict, str]:
    """bench/chaos.py with `flags`, seed 1: the process, its JSON report, and both for a
    failure message."""
    out = subprocess.run([sys.executable, str(CHAOS), *flags, "--seed", "1", "--json"],
                         capture_output=True, text=True, timeout=timeout)
    assert out.stdout, out.stderr[-4000:]
    r = json.loads(out.stdout)
    return out, r, f"{json.dumps(r, indent=1)}\n{out.stderr[-4000:]}"


def test_chaos_short_run_keeps_every_hit_correct_and_leaks_nothing():
    out, r, detail = run_chaos(SECONDS + 120, "--seconds", str(SECONDS), "--clients", "3",
                               "--kill-every", "2", "--restart-every", "4", "--disk-blocks", "96")
    assert r["mismatches"] == 0, detail
    assert (r["leaked_blocks"], r["leaked_leases"], r["shm_left"]) == (0, 0, 0), detail
    assert r["integrity"] == "ok" and r["integrity_failures"] == 0, detail
    assert r["fatal"] == 0 and r["internal_errors"] == 0 and r["server_crashes"] == 0, detail
    assert r["client_kills"] >= 1 and r["server_restarts"] >= 1, detail
    assert r["requests"] > 0 and r["verified_blocks"] > 0, detail
    assert r["disk_demoted_blocks"] > 0 and r["disk_promoted_blocks"] > 0, detail  # the tier served
    assert r["server_exit_code"] == 0 and out.returncode == 0, detail


@pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed")
def test_cluster_chaos_short_run_keeps_every_hit_correct_and_the_index_converges():
    out, r, detail = run_chaos(SECONDS + 145, "--cluster", "--members", "2", "--seconds",
                               str(SECONDS + 5), "--clients", "2", "--kill-every", "3",
                               "--restart-every", "2")  # each of 3 fault kinds, twice or so
    assert r["mismatches"] == 0, detail
    assert (r["leaked_blocks"], r["leaked_leases"], r["shm_left"]) == (0, 0, 0), detail
    assert r["integrity"] == "ok" and r["converged"], detail
    assert r["fatal"] == 0 and r["internal_errors"] == 0 and r["member_crashes"] == 0, detail
    assert min(r["member_kills"], r["router_kills"], r["etcd_kills"]) >= 1, detail
    assert r["routed"] > 0 and r["verified_blocks"] > 0, detail
    assert r["exit_code"] == 0 and out.returncode == 0, detail


@pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed")
def test_cluster_chaos_with_peer_fetch_serves_only_verified_blocks_and_leaks_nothing():
    """Members fetch each other's prefixes (engines send half their requests elsewhere than
    the router says) while members, the router and etcd are SIGKILLed: every hit verified, no
    lease or block left on any member."""
    out, r, detail = run_chaos(SECONDS + 145, "--cluster", "--peer-fetch", "--members", "2",
                               "--seconds", str(SECONDS + 5), "--clients", "2",
                               "--kill-every", "3", "--restart-every", "2")
    assert r["mismatches"] == 0 and r["unconfirmed_mismatches"] == 0, detail
    assert (r["leaked_blocks"], r["leaked_leases"], r["shm_left"]) == (0, 0, 0), detail
    assert r["integrity"] == "ok" and r["converged"], detail
    assert r["fatal"] == 0 and r["internal_errors"] == 0 and r["member_crashes"] == 0, detail
    assert r["member_kills"] >= 1 and r["peer_fetched_blocks"] > 0, detail
    assert r["exit_code"] == 0 and out.returncode == 0, detail
