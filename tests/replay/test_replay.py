"""radixkv replay against real `radixkv serve` processes, and the offline optimum.

- The optimum on hand-made traces, with exact hits, and its bounds (LRU <= MIN <= ceiling).
- The service replay with 1 client equals replay_tree request by request on slices of both
  Mooncake traces (block_size 512, capacities that force evictions, one that forces dropped
  blocks), with every hit's bytes verified: with LRU, with `adaptive`, and with `adaptive` and
  the retention hints derived from the trace.
- With several clients, verification still finds 0 mismatches; against a running server
  (--target); the CLI's JSON and plots.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _server import running_server

from radixkv.protocol.errors import InvalidArgument
from radixkv.replay.cluster import ReplayWindow
from radixkv.replay.hints import trace_hints
from radixkv.replay.optimum import NEVER, belady, ceiling, next_uses
from radixkv.replay.runner import block_keys, render_report, run_replay
from radixkv.replay.simulate import replay_tree
from radixkv.replay.workload import generate_synthetic, load_trace

REPO = Path(__file__).resolve().parents[2]
TRACES = REPO / ".." / "shared" / "traces" / "mooncake"
needs_traces = pytest.mark.skipif(
    not TRACES.is_dir(),
    reason=f"Mooncake traces not found at {TRACES.resolve()} (see shared/traces/README.md)",
)


# ---- the optimum ---------------------------------------------------------------------------


def test_next_uses() -> None:
    assert next_uses([["a", "b"], ["c"], ["a", "b"]]) == [3, 4, NEVER, NEVER, NEVER]


def test_belady_hand_made_exact() -> None:
    #        r0: s x1 x2   r1: s y1   r2: s x1   r3: s y1        capacity 2
    # r0 offers 3: x2 (never used again) goes          -> {s, x1}
    # r1 hits s; y1 (next use r3) is farther than x1 (r2): y1 goes at once (bypass)
    # r2 hits s x1; r3 hits s, y1 is offered, one block goes
    trace = [["s", "x1", "x2"], ["s", "y1"], ["s", "x1"], ["s", "y1"]]
    r = belady(trace, 2)
    assert r.per_request_hit_blocks == (0, 1, 2, 1)
    assert (r.hit_blocks, r.num_blocks, r.num_evicted_blocks, r.peak_cached_blocks) == (4, 9, 3, 2)
    assert ceiling(trace).per_request_hit_blocks == (0, 1, 2, 2)
    # LRU over the same chains hits 3: r1 evicts x1, r2 evicts y1, r3 evicts x1 again
    assert belady(trace, 3).per_request_hit_blocks == (0, 1, 2, 2)
    assert belady(trace, 0).hit_blocks == 0


def test_belady_evicts_leaves_only() -> None:
    # a long chain never reused but for its root: the deepest blocks go first, so the root
    # (the only block used again) survives even though every block ties at "never" but it
    trace = [["r", "a", "b", "c"], ["r"]]
    assert belady(trace, 1).per_request_hit_blocks == (0, 1)
    # q, never used again, is dropped at once rather than a block of the chain p-c
    trace = [["p", "c"], ["q"], ["p", "c"]]
    assert belady(trace, 2).per_request_hit_blocks == (0, 0, 2)


@pytest.mark.parametrize("capacity", [8, 64, 256])
def test_optimum_bounds_lru(capacity: int) -> None:
    requests = generate_synthetic(300, seed=capacity)
    keys = [block_keys(r.namespace, r.tokens, 16).tolist() for r in requests]
    lru = replay_tree(requests, 16, capacity, keep_per_request=True)
    opt, ceil = belady(keys, capacity), ceiling(keys)
    assert 0 < lru.hit_tokens <= opt.hit_blocks * 16 <= ceil.hit_blocks * 16
    assert ceil.hit_blocks * 16 == replay_tree(requests, 16, 10**6).hit_tokens


def test_block_keys() -> None:
    a = generate_synthetic(1, seed=1)[0].tokens
    k = block_keys("ns", a, 16)
    assert len(k) == len(a) // 64
    assert block_keys("ns", a[:64 * 3], 16).tolist() == k[:3].tolist()  # prefix -> same keys
    assert block_keys("other", a, 16)[0] != k[0]
    assert block_keys("ns", a[:63], 16).size == 0


# ---- the service replay --------------------------------------------------------------------


@needs_traces
@pytest.mark.parametrize(("policy", "hints"), [("lru", False), ("adaptive", False),
                                              ("adaptive", True)])
@pytest.mark.parametrize(("name", "capacity"), [
    ("conversation_trace.jsonl", 512),
    ("synthetic_trace.jsonl", 200),  # prompts up to 374 blocks: some cannot be cached whole
])
def test_one_client_equals_replay_tree(name: str, capacity: int, policy: str,
                                       hints: bool) -> None:
    requests = load_trace(TRACES / name, 250)
    r = run_replay(requests, block_size=512, capacity_blocks=capacity, clients=1,
                   policy=policy, hints=hints)
    tree = replay_tree(requests, 512, capacity, policy, keep_per_request=True,
                       hints=trace_hints(requests, 512) if hints else None)
    assert r.per_request_hit_tokens == tree.per_request_hit_tokens
    assert r.hit_tokens == tree.hit_tokens == r.server_hit_tokens > 0
    assert r.evicted_blocks == tree.num_evicted_blocks > 0
    assert r.dropped_blocks == tree.num_dropped_blocks
    assert r.prompt_tokens == tree.prompt_tokens and r.num_requests == 250
    assert r.verified_blocks == r.hit_tokens // 512 and r.mismatches == 0
    assert r.integrity == "ok"
    assert 0 <= r.token_hit_rate <= r.optimum_token_hit_rate <= r.ceiling_token_hit_rate
    assert r.optimum_hit_tokens > r.hit_tokens  # LRU is short of the optimum here
    if name.startswith("synthetic"):
        assert r.dropped_blocks > 0


@needs_traces
def test_several_clients_verify() -> None:
    requests = load_trace(TRACES / "conversation_trace.jsonl", 250)
    r = run_replay(requests, block_size=512, capacity_blocks=256, clients=3)
    assert r.num_requests == 250 and r.verified_blocks > 0 and r.mismatches == 0
    assert r.evicted_blocks > 0 and r.integrity == "ok"
    assert r.hit_tokens == r.server_hit_tokens
    assert r.token_hit_rate <= r.ceiling_token_hit_rate
    render_report(r)  # renders without error


@needs_traces
def test_verified_replays_count_the_lookup_tables_pin_misses() -> None:
    """A verified replay reads the lookup table before each Match: with one client the Match
    finds every block the table gave (nothing evicts in between: 0 pin misses, the same hits
    as without the reads); with three clients evicting meanwhile, few; no wrong bytes."""
    requests = load_trace(TRACES / "conversation_trace.jsonl", 250)
    one = run_replay(requests, block_size=512, capacity_blocks=256, clients=1)
    plain = run_replay(requests, block_size=512, capacity_blocks=256, clients=1, verify=False)
    assert one.peeked_blocks == one.hit_tokens // 512 > 0 and one.pin_missed_blocks == 0
    assert one.per_request_hit_tokens == plain.per_request_hit_tokens
    assert plain.peeked_blocks == 0
    many = run_replay(requests, block_size=512, capacity_blocks=256, clients=3)
    assert many.peeked_blocks > 0 and many.mismatches == 0 and many.integrity == "ok"
    assert many.pin_missed_blocks <= many.peeked_blocks // 10
    render_report(many)


def test_against_running_server() -> None:
    requests = generate_synthetic(150, seed=3)
    with running_server(num_blocks=1024) as srv:
        r = run_replay(requests, target=f"unix://{srv.socket}", clients=2)
        again = run_replay(requests, target=f"unix://{srv.socket}", clients=1)
    assert (r.block_size, r.capacity_blocks) == (4, 1024)
    assert r.mismatches == again.mismatches == 0 and r.verified_blocks > 0
    assert r.evicted_blocks > 0 and r.hit_tokens == r.server_hit_tokens
    assert again.hit_tokens == again.server_hit_tokens  # a fresh namespace prefix per run
    assert any("prefixed" in n for n in r.notes)


def test_cli_json_and_plots(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "radixkv", "replay", "--trace", "synthetic", "--requests",
         "120", "--clients", "2", "--capacity-blocks", "128", "--json", "--plots",
         str(tmp_path)],
        capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["num_requests"] == 120 and report["mismatches"] == 0
    assert report["block_size"] == 16 and report["clients"] == 2
    for key in ("p50", "p99", "p999"):
        assert report["match_us"][key] > 0 and report["insert_us"][key] > 0
    assert report["prefill_saved"]["tokens"] == report["hit_tokens"]
    assert report["windows"] and "match_samples_us" not in report
    assert [Path(p).name for p in report["plots"]] == ["hit_rate_over_time.png",
                                                        "latency_cdf.png"]
    assert all(Path(p).stat().st_size > 1000 for p in report["plots"])


def test_windowed_replay_holds_more_conversations_in_the_same_memory() -> None:
    """A sliding-window pool (window parts for the last blocks only) verified end to end, and
    against the same bytes spent on every layer's KV of every block: more conversations held.
    The tiny replay layout has 2 layers (1 full, 1 windowed): a block of both costs 2 parts."""
    requests = generate_synthetic(300, seed=5, num_active=24)
    w = ReplayWindow(sliding_window=33, window_parts=200)  # 2 blocks of 16 per resume point
    aware = run_replay(requests, block_size=16, capacity_blocks=1600, clients=2, window=w,
                       conversations=True)
    base = run_replay(requests, block_size=16, capacity_blocks=(1600 + 200) // 2, clients=2,
                      conversations=True)
    for r in (aware, base):
        assert r.mismatches == 0 and r.verified_blocks > 0 and r.integrity == "ok"
        assert 0 < r.conversations_held <= r.conversations == base.conversations
    assert aware.window_parts == 200 and any("window parts" in n for n in aware.notes)
    assert aware.conversations_held > base.conversations_held
    assert aware.token_hit_rate > base.token_hit_rate
    render_report(aware)
    with pytest.raises(InvalidArgument, match="two round trips"):
        run_replay(requests, block_size=16, window=w, round_trips=4)


def test_cli_windowed_preset_and_its_all_full_baseline() -> None:
    def replay(*flags: str) -> dict:
        out = subprocess.run(
            [sys.executable, "-m", "radixkv", "replay", "--trace", "synthetic", "--requests",
             "150", "--memory", "512MiB", "--preset", "gpt-oss-like", "--conversations",
             "--json", *flags], capture_output=True, text=True, cwd=REPO, timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    aware, base = replay("--window-fraction", "0.2"), replay("--all-full")
    assert aware["window_parts"] > 0 and base["window_parts"] == 0
    assert aware["capacity_blocks"] > base["capacity_blocks"]  # full parts: half the bytes
    assert any("window fraction 0.200" in n for n in aware["notes"])
    for r in (aware, base):
        assert r["mismatches"] == 0 and r["integrity"] == "ok"
        assert r["conversations"] > 0 and 0 <= r["conversations_held"] <= r["conversations"]
    bad = subprocess.run([sys.executable, "-m", "radixkv", "replay", "--all-full"],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert bad.returncode != 0 and "size a --memory budget" in bad.stderr
