"""bench/chaos.py, CI-sized: ~30 s of verified replay from 3 client processes while clients are
SIGKILLed mid-lease and the server (with a disk tier below its pool) is SIGKILLed and restarted on
the same socket; and ~30 s of its cluster mode (etcd, 2 members, a router; members, the router
and etcd SIGKILLed)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CHAOS = Path(__file__).resolve().parents[2] / "bench" / "chaos.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def run_chaos(timeout: float, *flags: str) -> tuple[subprocess.CompletedProcess, dict, str]:
    """bench/chaos.py with `flags`, seed 1: the process, its JSON report, and both for a
    failure message."""
    out = subprocess.run([sys.executable, str(CHAOS), *flags, "--seed", "1", "--json"],
                         capture_output=True, text=True, timeout=timeout)
    assert out.stdout, out.stderr[-4000:]
    r = json.loads(out.stdout)
    return out, r, f"{json.dumps(r, indent=1)}\n{out.stderr[-4000:]}"


def test_chaos_short_run_keeps_every_hit_correct_and_leaks_nothing():
    out, r, detail = run_chaos(150, "--seconds", "30", "--clients", "3", "--kill-every", "2",
                               "--restart-every", "5", "--disk-blocks", "96")
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
    out, r, detail = run_chaos(170, "--cluster", "--members", "2", "--seconds", "30",
                               "--clients", "2", "--kill-every", "3", "--restart-every", "4")
    assert r["mismatches"] == 0, detail
    assert (r["leaked_blocks"], r["leaked_leases"], r["shm_left"]) == (0, 0, 0), detail
    assert r["integrity"] == "ok" and r["converged"], detail
    assert r["fatal"] == 0 and r["internal_errors"] == 0 and r["member_crashes"] == 0, detail
    assert min(r["member_kills"], r["router_kills"], r["etcd_kills"]) >= 1, detail
    assert r["routed"] > 0 and r["verified_blocks"] > 0, detail
    assert r["exit_code"] == 0 and out.returncode == 0, detail
