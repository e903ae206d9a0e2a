"""The light benchmarks still run end to end (tiny sizes; their figures are not checked here)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def leaked_pools(before: set[str]) -> list[str]:
    """Pool segments (<prefix>-<owner pid>-<epoch>) in /dev/shm that were not there `before`
    and whose owner is gone: leaked. Other processes on the machine may hold live ones."""
    new = (re.fullmatch(r"(radixkv|rkvbench)-(\d+)-\w+", n)
           for n in set(os.listdir("/dev/shm")) - before)
    return [m[0] for m in new if m and not os.path.exists(f"/proc/{m[2]}")]


def run(*args: str) -> str:
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.parametrize("args", [
    ("token_encoding.py", "--sizes", "64", "--repeat", "3", "--json"),
    ("pool_copy.py", "--blocks", "4", "--repeat", "1", "--json"),
    ("pool_copy.py", "--blocks", "2", "--repeat", "1", "--model-dtype", "bf16", "--json"),
], ids=["token_encoding", "pool_copy", "pool_copy_bf16"])
def test_bench_prints_json(args):
    json.loads(run(str(BENCH / args[0]), *args[1:]))


def test_disk_tier_bench_io_figures():
    """bench/disk_tier.py's I/O half at its smallest (the TTFT half needs SmolLM2)."""
    report = json.loads(run(str(BENCH / "disk_tier.py"), "--no-model", "--prompts", "6",
                            "--pool-blocks", "32", "--preset", "smollm2-135m", "--json"))
    assert report["warm_restart_hit_fraction"] == 1.0 and report["wrong_blocks"] == 0
    assert report["demote_vs_fs_write"] > 0 and report["promote_vs_fs_read"] > 0
    # the read floor is the faster of the tier-like and the dd-like read of the same bytes
    assert report["fs_read_GBps"] == max(report["fs_read_tier_like_GBps"],
                                         report["fs_read_dd_GBps"]) > 0


def test_demote_lock_bench():
    """bench/demote_lock.py at its smallest: Matches timed while Allocates demote."""
    report = json.loads(run(str(BENCH / "demote_lock.py"), "--preset", "smollm2-135m",
                            "--pool-blocks", "40", "--alloc-blocks", "8", "--disk-blocks",
                            "64", "--seconds", "0.5", "--json"))
    assert report["matches"] > 0 and report["allocates"] > 0
    assert report["demoted_blocks_per_s"] > 0 and report["match_p99_us"] > 0


def test_workload_to_tree_replay(tmp_path):
    trace = tmp_path / "w.jsonl"
    run(str(BENCH / "gen_workload.py"), "--requests", "40", "--out", str(trace))
    report = json.loads(run(str(BENCH / "tree_replay.py"), "--trace", str(trace),
                            "--block-size", "16", "--capacity-blocks", "512", "--no-memory",
                            "--json"))
    assert report["requests"] == 40 and 0 < report["token_hit_rate"] < 1


@pytest.mark.slow
def test_tree_replay_beside_sglangs_rust_tree():
    """--sglang replays the same requests through SGLang's Rust tree (.venv-sglang): both trees
    evict under the same capacity and hit the same tokens (LRU picks the same victims up to
    ties), and the figures come side by side."""
    if not (BENCH.parent / ".venv-sglang" / "bin" / "python").exists():
        pytest.fail(".venv-sglang is missing: run `bash scripts/bootstrap_sglang`")
    report = json.loads(run(str(BENCH / "tree_replay.py"), "--requests", "120",
                            "--capacity-blocks", "1024", "--policy", "lru", "--no-memory",
                            "--warmup", "20", "--sglang", "--rounds", "1", "--json"))
    r = report["sglang"]
    assert r["available"] and r["rounds"] == 1, r
    assert report["evicted_blocks"] > 0 and r["sglang"]["evicted_blocks"] > 0
    assert abs(r["radixkv"]["token_hit_rate"] - r["sglang"]["token_hit_rate"]) < 0.01
    assert r["radixkv"]["token_hit_rate"] == report["token_hit_rate"]
    for k in ("match_p50", "match_p50_over_call", "match_p50_over_walk", "insert_p50",
              "requests_per_s"):
        assert r["ratio"][k] > 0


def test_tree_replay_sglang_with_a_policy_it_lacks_says_why():
    """A policy SGLang's tree lacks: the replay still reports, and says why nothing was
    compared."""
    out = subprocess.run([sys.executable, str(BENCH / "tree_replay.py"), "--requests", "20",
                          "--policy", "adaptive", "--no-memory", "--sglang", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["requests"] == 20 and not report["sglang"]["available"]
    assert "not compared" in out.stderr and "adaptive" in report["sglang"]["reason"]


def test_tree_scale_reports_each_size():
    report = json.loads(run(str(BENCH / "tree_replay.py"), "--scale", "--scale-sizes",
                            "2000,6000", "--json"))
    assert [r["cached_blocks"] for r in report["scale"]] == [2000, 6000]
    for row in report["scale"]:
        assert row["match_p50_us"] > 0 and row["insert_p50_us"] > 0
        assert 0 < row["bytes_per_block"] < 1000 and row["token_bytes_per_block"] == 64


def compare_bench(name: str):  # noqa: ANN201 - bench/compare.py's Bench
    """bench/compare.py's entry for bench `name` (its commands and its figures)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_compare", BENCH / "compare.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    [bench] = [b for b in module.benches("synthetic") if b.name == name]
    return bench


def test_rpc_latency_runs_every_case():
    """The rpc bench end to end at its smallest (bench/compare.py's smoke run of it: one round,
    one process of each server), the figures compare reads from it; its servers (the
    in-bench aio one holds a pool) leave no shared memory behind."""
    before = set(os.listdir("/dev/shm"))
    bench = compare_bench("rpc")
    assert bench.smoke[0] == "bench/rpc_latency.py"
    report = json.loads(run(str(BENCH.parent / bench.smoke[0]), *bench.smoke[1:]))
    figures = bench.figures(report)
    assert set(figures) == {"cycle_two_1_requests_per_s", "cycle_two_n_requests_per_s",
                            "match_p50_us"} and min(figures.values()) > 0
    unix = report["unix"]
    assert set(unix["ratios"]) == {"match_p50_over_echo_p50", "match_n_over_echo_n_throughput",
                                   "stub_n_over_echo_n_throughput",
                                   "batched_over_unbatched_requests_per_s",
                                   "cycle_two_over_four_1", "cycle_two_over_four_n"}
    assert len(unix["match_n_over_echo_n_by_round"]) == 1 and unix["match_n"]["calls_per_s"] > 0
    assert report["aio_unix"]["match_1"]["p50_us"] > 0
    assert leaked_pools(before) == []


def test_ttft_and_accuracy_benches_on_the_real_model(smollm2):
    """The JSON shapes the checks read, at the smallest sizes (figures: docs/benchmarks.md)."""
    report = json.loads(run(str(BENCH / "ttft.py"), "--model", "smollm2-135m",
                            "--prompt-tokens", "64", "--shares", "0,50", "--repeat", "1",
                            "--turns", "2", "--answer-tokens", "4", "--json"))
    assert [r["shared_pct"] for r in report["rows"]] == [0, 50]
    assert all(r["ratio"] > 0 and r["radixkv_overhead_ms"] >= 0 for r in report["rows"])
    assert [t["cached_tokens"] > 0 for t in report["turns"]] == [False, True]
    report = json.loads(run(str(BENCH / "kv_accuracy.py"), "--contexts", "64", "--windows", "1",
                            "--json"))
    assert report["model"] == "smollm2-135m"
    [row] = report["rows"]
    assert set(row) >= {"kv_dtype", "context", "ppl_reference", "ppl_pool", "delta_ppl_pct",
                        "max_abs_logit_diff"}
    assert (row["kv_dtype"], row["context"]) == ("fp32", 64)


def test_policy_gap_rows():
    traces = BENCH.parent / ".." / "shared" / "traces" / "mooncake"
    if not traces.is_dir():
        pytest.skip(f"Mooncake traces not found at {traces}")
    out = json.loads(run(str(BENCH / "policy_gap.py"), "--traces",
                         str(traces / "conversation_trace.jsonl"), "--capacities", "64",
                         "--limit", "150", "--plot", "", "--json"))
    rows = {r["policy"]: r for r in out["rows"]}
    assert list(rows) == ["lru", "lfu", "adaptive", "adaptive+hints", "belady"]
    assert set(rows["lru"]) == {"trace", "capacity_blocks", "policy", "token_hit_rate",
                                "gap_closed"}
    assert rows["lru"]["gap_closed"] == 0 and rows["belady"]["gap_closed"] == 1
    assert all(r["token_hit_rate"] <= rows["belady"]["token_hit_rate"] for r in out["rows"])


def test_swa_capacity_rows(tmp_path):
    """A tiny Mooncake-shaped trace (six conversations of four turns on one shared first
    block): both runs verified, the rows the issue's check reads."""
    lines = []
    for turn in range(4):
        for conv in range(6):
            ids = [0] + [1000 * conv + i for i in range(1, 3 * turn + 4)]
            lines.append(json.dumps({"timestamp": 10 * (4 * turn + conv), "output_length": 8,
                                     "input_length": 512 * len(ids) - 100, "hash_ids": ids}))
    trace = tmp_path / "conv.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    out = json.loads(run(str(BENCH / "swa_capacity.py"), "--trace", str(trace), "--memory",
                         "1GiB", "--layouts", "gpt-oss-like", "--json"))
    (row,) = out["rows"]
    assert row["layout"] == "gpt-oss-like" and row["mismatches"] == 0
    assert row["verified_blocks"] > 0 and row["integrity"] == "ok/ok"
    assert row["conversations"] == 6 and row["conversations_ratio"] > 1
    assert row["hit_rate_windowed"] > row["hit_rate_all_full"]


def test_pool_copy_leaves_no_shared_memory_on_sigterm():
    import os
    import signal
    import time

    def ours() -> set[str]:
        return {n for n in os.listdir("/dev/shm") if n.startswith(f"rkvbench-{proc.pid}-")}

    proc = subprocess.Popen([sys.executable, str(BENCH / "pool_copy.py"), "--blocks", "64",
                             "--repeat", "50"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not ours() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert ours(), "the bench never created its pool"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 128 + signal.SIGTERM
    assert not ours()


@pytest.mark.slow
def test_compare_runs_every_bench_on_two_worktrees_and_removes_them():
    """bench/compare.py at smoke size, HEAD against HEAD: every headline bench but rpc (whose
    smoke run and figures test_rpc_latency_runs_every_case checks) gives its figures on both
    sides (one round, so one ratio each), and the two worktrees, the servers'
    shared memory and sockets are gone afterwards."""
    repo = BENCH.parent

    def worktrees() -> set[str]:
        out = subprocess.run(["git", "-C", str(repo), "worktree", "list", "--porcelain"],
                             capture_output=True, text=True, check=True).stdout
        return {line for line in out.splitlines() if line.startswith("worktree ")}

    before_trees, before_shm = worktrees(), set(os.listdir("/dev/shm"))
    out = subprocess.run([sys.executable, str(BENCH / "compare.py"), "HEAD", "HEAD", "--smoke",
                          "--benches", "tree,copy,ttft,replay,cluster",  # rpc: its own test
                          "--rounds", "1", "--json"], capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["failures"] == []
    assert report["base_commit"] == report["head_commit"]
    by_bench: dict[str, set[str]] = {}
    for row in report["figures"]:
        by_bench.setdefault(row["bench"], set()).add(row["figure"])
        assert row["rounds"] == 1 and row["ratio"] == pytest.approx(row["head"] / row["base"])
    assert by_bench["tree"] == {"requests_per_s", "match_p50_us", "insert_p50_us"}
    assert by_bench["ttft"] == {"ratio_50"}
    assert {"replay", "cluster", "copy"} <= set(by_bench) and "rpc" not in by_bench
    assert worktrees() == before_trees
    assert leaked_pools(before_shm) == []


def test_compare_refuses_what_is_not_a_commit():
    out = subprocess.run([sys.executable, str(BENCH / "compare.py"), "no-such-rev", "--smoke"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "not a commit here" in out.stderr


@pytest.mark.slow
def test_peer_fetch_bench_runs_and_leaves_nothing():
    """bench/peer_fetch.py at its smallest (etcd and two members): a figure for each block
    size, and no pool segment or temp dir left behind."""
    import tempfile

    shm_before = set(os.listdir("/dev/shm"))
    tmp_before = set(os.listdir(tempfile.gettempdir()))
    report = json.loads(run(str(BENCH / "peer_fetch.py"), "--mib", "4", "--rounds", "1",
                            "--block-kib", "1024,64", "--json"))
    assert [r["block_kib"] for r in report["rows"]] == [1024, 64]
    assert all(r["fetch_gbps"] > 0 and r["tcp_floor_gbps"] > 0 for r in report["rows"])
    assert leaked_pools(shm_before) == []
    assert [n for n in set(os.listdir(tempfile.gettempdir())) - tmp_before
            if n.startswith("rkv-pfb-")] == []


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not (BENCH.parent / ".venv-lmcache" / "bin" / "python").exists(),
                    reason="no .venv-lmcache (scripts/bootstrap_lmcache: the LMCache "
                    "comparison's venv, outside the test command's set-up)")
def test_vllm_bench_beside_lmcache_runs_and_leaves_nothing():
    """bench/vllm_ttft.py --lmcache at its smallest: radixkv's and LMCache's rows, both outputs
    equal to vLLM's prefix cache, and LMCache's server stopped with its shared memory gone."""
    shm_before = set(os.listdir("/dev/shm"))
    out = subprocess.run([sys.executable, str(BENCH / "vllm_ttft.py"), "--lmcache", "--shares",
                          "90", "--repeat", "1", "--prompt-tokens", "600", "--max-tokens", "4",
                          "--json"], capture_output=True, text=True, timeout=840)
    assert out.returncode == 0, out.stderr[-3000:]
    (row,) = json.loads(out.stdout)["rows"]
    assert row["radixkv_hit_tokens"] == 512 and row["lmcache_hit_tokens"] == 512  # 540 shared
    assert row["outputs_identical_to_vllm_prefix_cache"] and row["outputs_identical_lmcache"]
    assert leaked_pools(shm_before) == []
    assert [n for n in set(os.listdir("/dev/shm")) - shm_before if "lmcache" in n] == []
    assert subprocess.run(["pgrep", "-f", "lmcache server"], capture_output=True).stdout == b""


def test_kv_events_bench_reports_latency_and_bursts():
    """bench/kv_events.py at its smallest: both figures, and no pool segment left."""
    shm_before = set(os.listdir("/dev/shm"))
    report = json.loads(run(str(BENCH / "kv_events.py"), "--prompts", "20", "--burst", "2000",
                            "--json"))
    assert report["publish_p50_ms"] > 0 and report["events_per_s"] > 0
    assert report["burst_events"] == 2000
    assert leaked_pools(shm_before) == []
