"""`radixkv inspect | stats | events` as subprocesses against a real server after a scripted
sequence: the --json outputs carry exact counts; the human views render."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
from _server import REPO, running_server

from radixkv.client import Client

SYS = list(range(1, 9))  # a shared 2-block system prompt
Q1, Q2 = [20, 21, 22, 23], [30, 31, 32, 33]
LONG = list(range(40, 72))  # 8 blocks


def request(kv: Client, ns: str, tokens: list[int]) -> None:
    with kv.lease(ns, tokens) as lease:
        missing = len(tokens) // 4 - lease.num_tokens // 4
        new = lease.allocate(missing) if missing else ()
        lease.insert(tokens, lease.block_ids + new)


@pytest.fixture(scope="module")
def server():
    """14 blocks. The chat tree ends up as (node ids as the tree assigns them):

        root -- n2 [SYS] blocks 1 2 --- n1 [Q1] block 3 --- n4 [LONG] blocks 5..12
                                     \\-- n3 [Q2] block 4

    n1 was inserted as SYS+Q1 and split by the first match of SYS (the front became n2). A
    lease stays open pinning SYS+Q2, and a second holds 2 blocks allocated in `docs`, which
    evicted docs' only block (the least recently used leaf, in the least recently used
    namespace)."""
    with running_server(num_blocks=14) as s, Client(s.socket) as kv:
        request(kv, "docs", [100, 101, 102, 103])  # block 0          event 1
        request(kv, "chat", SYS + Q1)  # blocks 1 2 3                 event 2
        request(kv, "chat", SYS + Q2)  # hit 8; block 4               event 3
        request(kv, "chat", SYS + Q1)  # hit 12
        request(kv, "chat", SYS + Q1 + LONG)  # hit 12; blocks 5..12   event 4
        request(kv, "chat", SYS + Q1 + LONG)  # hit 44
        held = kv.match("chat", SYS + Q2)  # hit 12, pins n2 and n3
        extra = kv.allocate(2, namespace="docs")  # evicts block 0     event 5
        assert held.num_tokens == 12 and extra.block_ids == (13, 0)
        yield s
        kv.release(held.lease_id, extra.lease_id)


def cli(server, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([sys.executable, "-m", "radixkv", *args, "--socket", server.socket],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    if check:
        assert out.returncode == 0, out.stderr
    return out


def cli_json(server, *args: str):
    return json.loads(cli(server, *args, "--json").stdout)


def strip_ages(node):
    node = {k: v for k, v in node.items() if k != "age_s"}
    if "children" in node:
        node["children"] = [strip_ages(c) for c in node["children"]]
    return node


def test_summary_json(server):
    d = cli_json(server, "inspect")
    assert d["pool"]["blocks"] == {"total": 14, "free": 0, "leased": 2, "cached": 12,
                                   "pinned": 3}
    assert d["pool"]["bytes"]["total"] == 14 * 1024 and d["pool"]["backend"] == "host"
    assert d["pool"]["layout"]["block_size"] == 4
    lifetime = {"requests": 7, "query_tokens": 140, "hit_tokens": 88, "rate": 88 / 140}
    assert d["hit_rate"]["lifetime"] == pytest.approx(lifetime)
    assert d["hit_rate"]["recent"] == pytest.approx(lifetime)  # the window is 1000 requests
    assert d["evicted_blocks"] == 1 and d["leases"] == {"live": 2, "expired": 0}
    assert d["namespaces"] == [
        {"namespace": "chat", "cached_blocks": 12, "cached_tokens": 48, "nodes": 4,
         "requests": 6, "query_tokens": 136, "hit_tokens": 88, "evicted_blocks": 0,
         "hit_rate": pytest.approx(88 / 136)},
        {"namespace": "docs", "cached_blocks": 0, "cached_tokens": 0, "nodes": 0,
         "requests": 1, "query_tokens": 4, "hit_tokens": 0, "evicted_blocks": 1,
         "hit_rate": 0.0}]
    assert cli_json(server, "stats") == {**d, "uptime_s": pytest.approx(d["uptime_s"], abs=30)}


def test_tree_json_largest_subtree_first(server):
    n4 = {"node_id": 4, "tokens": 32, "blocks": 8, "depth_tokens": 44, "lock_count": 0,
          "hits": 1, "first_token_ids": LONG[:8], "block_ids": list(range(5, 13)),
          "subtree_tokens": 32, "subtree_blocks": 8, "children": [], "hidden_nodes": 0}
    n1 = {"node_id": 1, "tokens": 4, "blocks": 1, "depth_tokens": 12, "lock_count": 0,
          "hits": 3, "first_token_ids": Q1, "block_ids": [3], "subtree_tokens": 36,
          "subtree_blocks": 9, "children": [n4], "hidden_nodes": 0}
    n3 = {"node_id": 3, "tokens": 4, "blocks": 1, "depth_tokens": 12, "lock_count": 1,
          "hits": 1, "first_token_ids": Q2, "block_ids": [4], "subtree_tokens": 4,
          "subtree_blocks": 1, "children": [], "hidden_nodes": 0}
    n2 = {"node_id": 2, "tokens": 8, "blocks": 2, "depth_tokens": 8, "lock_count": 1,
          "hits": 5, "first_token_ids": SYS, "block_ids": [1, 2], "subtree_tokens": 48,
          "subtree_blocks": 12, "children": [n1, n3], "hidden_nodes": 0}
    t = cli_json(server, "inspect", "tree", "chat")
    assert strip_ages(t) == {"namespace": "chat", "last_sequence": 5, "depth": 0, "nodes": 4,
                             "cached_blocks": 12, "cached_tokens": 48, "children": [n2]}
    assert all(0 <= n["age_s"] < 60 for n in t["children"])
    shallow = cli_json(server, "inspect", "tree", "chat", "--depth", "1")
    assert strip_ages(shallow)["children"] == [{**n2, "children": [], "hidden_nodes": 3}]
    assert cli_json(server, "inspect", "tree", "docs")["children"] == []


def test_top_json_by_hits_and_tokens_saved(server):
    def ranks(*args: str):
        t = cli_json(server, "inspect", "top", "chat", *args)
        return [(r["node_id"], r["hits"], r["tokens_saved"]) for r in t["prefixes"]]

    # ties on hits go to the longer prefix
    assert ranks() == [(2, 5, 40), (1, 3, 36), (4, 1, 44), (3, 1, 12)]
    assert ranks("--by", "tokens-saved", "-n", "3") == [(4, 1, 44), (2, 5, 40), (1, 3, 36)]
    row = cli_json(server, "inspect", "--json", "top", "chat", "-n", "1")["prefixes"][0]
    assert row["first_token_ids"] == SYS and row["depth_blocks"] == 2
    deep = cli_json(server, "inspect", "top", "chat", "--by", "tokens-saved", "-n", "1")
    assert deep["prefixes"][0]["first_token_ids"] == SYS
    assert deep["prefixes"][0]["edge_token_ids"] == LONG[:8]


def test_events_json_lines(server):
    out = cli(server, "events", "--from", "1", "--count", "5", "--json").stdout
    events = [json.loads(line) for line in out.splitlines()]
    assert [(e["sequence"], e["namespace"], e["type"], e["block_ids"]) for e in events] == [
        (1, "docs", "BlockStored", [0]), (2, "chat", "BlockStored", [1, 2, 3]),
        (3, "chat", "BlockStored", [4]), (4, "chat", "BlockStored", list(range(5, 13))),
        (5, "docs", "BlockRemoved", [0])]
    assert events[1]["token_ids"] == SYS + Q1 and events[1]["parent_block_id"] is None
    assert events[3]["parent_block_id"] == 3 and events[3]["token_ids"] == LONG
    assert events[3]["parent_block_hash"] == events[1]["block_hashes"][2]
    assert events[4]["block_hashes"] == events[0]["block_hashes"]
    human = cli(server, "events", "--from", "1", "--namespace", "docs", "--count", "2").stdout
    assert [line.split()[0] for line in human.splitlines()] == ["#1", "#5"]
    assert "BlockRemoved blocks [0]" in human


def test_human_views_render(server):
    summary = cli(server, "inspect").stdout
    assert "0 free, 2 leased, 12 cached (3 of them pinned)" in summary
    assert "62.9%: 88 of 140 tokens, 7 requests" in summary
    tree = cli(server, "inspect", "tree", "chat", "--depth", "2").stdout
    assert "[1 2 3 4 5 6 7 8] 8 tok 2 blk (subtree 48 tok)  hits 5  locks 1" in tree
    assert "... 1 more nodes below" in tree
    assert "top prefixes by tokens-saved" in cli(server, "inspect", "top", "chat", "--by",
                                                  "tokens-saved").stdout
    missing = cli(server, "inspect", "tree", "nope", check=False)
    assert missing.returncode == 2 and "namespace 'nope' does not exist" in missing.stderr


def test_stats_watch_stops_cleanly_on_ctrl_c(server):
    proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "radixkv", "stats",
                             "--watch", "0.1", "--json", "--socket", server.socket],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout is not None
    first, second = proc.stdout.readline(), proc.stdout.readline()
    assert json.loads(first)["leases"] == json.loads(second)["leases"] == {"live": 2,
                                                                          "expired": 0}
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:  # where it hangs: faulthandler prints every thread
        proc.send_signal(signal.SIGABRT)
        _, err = proc.communicate(timeout=10)
        raise AssertionError(f"`stats --watch` did not stop on Ctrl-C:\n{err[-4000:]}") from None
    assert proc.returncode == 0 and err == ""


def test_no_server_is_a_clear_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "radixkv", "inspect", "--socket",
                          str(tmp_path / "none.sock")], capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    assert out.returncode == 2 and out.stderr.startswith("radixkv inspect: ")


def test_inspector_escapes_what_it_prints():
    from rich.console import Console

    from radixkv.cli.commands.events import event_line
    from radixkv.cli.render import markup_safe
    from radixkv.cli.summary import render_summary

    assert event_line({"type": "AllBlocksCleared", "sequence": 1, "timestamp": 0,
                       "namespace": "a\x1b[2Jb"}).endswith("a\\x1b[2Jb AllBlocksCleared")
    d = {"target": "[red]t", "uptime_s": 1, "epoch": "e", "evicted_blocks": 0,
         "leases": {"live": 0, "expired": 0},
         "pool": {"backend": "host", "bytes": {"total": 1, "free": 1, "cached": 0},
                  "blocks": {"total": 1, "free": 1, "leased": 0, "cached": 0, "pinned": 0},
                  "layout": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1,
                             "dtype": "fp16", "block_size": 1, "bytes_per_block": 4}},
         "hit_rate": {"lifetime": {"requests": 0, "query_tokens": 0, "hit_tokens": 0,
                                   "rate": None}},
         "namespaces": [{"namespace": "[bold]ns", "cached_blocks": 0, "cached_tokens": 0,
                         "nodes": 0, "requests": 0, "hit_rate": None, "evicted_blocks": 0}]}
    console = Console(record=True, width=120)
    console.print(render_summary(d))
    text = console.export_text()
    assert "[red]t" in text and "[bold]ns" in text
    assert markup_safe("\x07[x]") == "\\x07\\[x]"
