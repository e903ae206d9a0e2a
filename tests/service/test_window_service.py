"""A sliding-window pool through the real server: full and window parts allocated, written,
inserted, matched and evicted apart; real bytes compared from a second process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from radixkv.client import Client
from radixkv.protocol.errors import InvalidArgument, OutOfBlocks, PermissionDenied
from radixkv.protocol.limits import HOLE
from tests._server import BLOCK_SIZE, running_server

B = BLOCK_SIZE
# the tiny layout's 2 layers, layer 0 windowed: W = 9 tokens -> window_blocks = ceil(8 / 4) = 2
WINDOW = ("--sliding-window", "9", "--window-layers", "0")


def prompt(seed: int, blocks: int) -> list[int]:
    return [seed * 1000 + i for i in range(blocks * B)]


def kv(layers: int, tokens: int, seed: float) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.arange(layers * tokens * 2 * 8, dtype=torch.float32).reshape(layers, tokens, 2, 8)
    return k + seed, -k - seed


def store(kv_client: Client, tokens: list[int], seed: float) -> tuple[int, ...]:
    """One request on the two-trip path: match, write both parts of the new blocks (window
    parts where the Match allocated them: aligned to the end, HOLE where none), insert.
    Returns the window parts written."""
    with kv_client.lease("ns", tokens) as lease:
        pool = lease.pool()
        n, d = len(tokens) // B, lease.num_tokens // B
        assert len(lease.new_block_ids) == n - d and lease.window_end == n
        wins = lease.new_window_ids
        assert wins[-min(n - d, 2):] == tuple(w for w in wins[-2:] if w != HOLE)  # the tail
        if lease.new_block_ids:
            pool.write(lease.new_block_ids, *kv(1, (n - d) * B, seed))
        first = n - len(wins)
        for i, w in enumerate(wins, first):
            if w != HOLE:
                k, v = kv(1, (n - first) * B, seed + 0.5)
                pool.write_window([w], k[:, (i - first) * B:(i - first + 1) * B],
                                  v[:, (i - first) * B:(i - first + 1) * B])
        lease.insert(tokens, lease.block_ids + lease.new_block_ids, release=True,
                     window_ids=wins)
        return tuple(w for w in wins if w != HOLE)


def hit(c: Client, tokens: list[int]) -> int:
    """Tokens resumable now (a match whose lease ends at once)."""
    with c.lease("ns", tokens, store_tokens=0) as lease:
        return lease.num_tokens


def test_two_parts_round_trip_and_resume_points() -> None:
    with running_server(*WINDOW, "--num-window-blocks", "6", num_blocks=12) as server, \
            Client(server.socket) as c:
        info = c.pool_info()
        assert info.layout.window_blocks == 2 and info.handle.num_window_blocks == 6
        t = prompt(1, 5)
        wins = store(c, t, 1.0)
        with c.lease("ns", t, store_tokens=0) as lease:  # resumable at the end: 5 blocks
            assert lease.num_tokens == 5 * B and lease.window_ids == wins
            k, v = lease.pool().read(lease.block_ids)
            want_k, want_v = kv(1, 5 * B, 1.0)
            assert torch.equal(k, want_k) and torch.equal(v, want_v)
            wk, wv = lease.pool().read_window(lease.window_ids)
            want_k, want_v = kv(1, 2 * B, 1.5)
            assert torch.equal(wk, want_k) and torch.equal(wv, want_v)
        assert hit(c, t[:3 * B] + [7] * B) == 0  # blocks 1, 2: window parts never stored
        # a request that branches off at block 3: it stores its new tail's window parts and
        # those of blocks 1, 2 (before the branch point, missing), so the point resumes
        branch = t[:3 * B] + prompt(2, 2)
        branch_wins = store(c, branch, 2.0)
        assert len(branch_wins) == 4
        assert hit(c, t[:3 * B] + prompt(3, 1)) == 3 * B
        with c.lease("ns", branch, store_tokens=0) as lease:
            assert lease.num_tokens == 5 * B and lease.window_ids == branch_wins[2:]
            wk, _ = lease.pool().read_window(lease.window_ids)
            assert torch.equal(wk, kv(1, 4 * B, 2.5)[0][:, 2 * B:])
        st = c.stats(check_integrity=True)
        assert st["integrity"] == "ok"
        assert st["window_blocks"] == 6 and st["cached_window_blocks"] == 6
        nodes, _ = c.dump_tree("ns")
        assert sorted(w for n in nodes for w in n.window_ids if w != HOLE) == sorted(
            wins + branch_wins)


def test_window_eviction_keeps_each_branch_tail() -> None:
    """6 window parts, 3 stored per conversation (one re-stored after a resume): old
    conversations' out-of-tail windows go first, every leaf stays resumable at its end."""
    with running_server(*WINDOW, "--num-window-blocks", "4", "--policy", "lru",
                        num_blocks=40) as server, \
            Client(server.socket) as c:
        a = prompt(1, 3)
        store(c, a, 1.0)
        store(c, a + prompt(3, 2), 3.0)  # a's tail windows now lie behind the new tail
        store(c, prompt(2, 3), 2.0)  # needs 2 window parts: a's old tail's are freed
        events = [e for e in c.events(from_sequence=1, timeout=0.5)]
        kinds = [e.WhichOneof("kind") for e in events]
        assert "window_removed" in kinds and "window_stored" in kinds
        assert hit(c, a + prompt(3, 2)) == 5 * B
        assert hit(c, prompt(2, 3)) == 3 * B
        assert hit(c, a) == 0
        # both leaves' tails are protected: more windows cost a whole leaf (the older one)
        store(c, prompt(4, 2), 4.0)
        assert hit(c, a + prompt(3, 2)) < 5 * B
        assert hit(c, prompt(4, 2)) == 2 * B
        assert hit(c, prompt(2, 3)) == 3 * B
        assert c.stats(check_integrity=True)["integrity"] == "ok"


def test_window_bad_input() -> None:
    with running_server(*WINDOW, "--num-window-blocks", "4", num_blocks=12) as server, \
            Client(server.socket) as c:
        t = prompt(1, 3)
        with c.lease("ns", t) as lease:
            ids, wins = lease.block_ids + lease.new_block_ids, lease.new_window_ids
            with pytest.raises(InvalidArgument, match="window parts for 3 full blocks"):
                lease.insert(t, ids, window_ids=wins + (ids[0], ids[1]))
            with pytest.raises(InvalidArgument, match="not a window part of this pool"):
                lease.insert(t, ids, window_ids=(ids[0],))
            other = c.allocate(0, namespace="ns", num_window_blocks=1)
            with pytest.raises(PermissionDenied, match="leased to another lease"):
                lease.insert(t, ids, window_ids=other.window_ids)
            c.release(other.lease_id)
            lease.insert(t, ids, window_ids=wins)
        with c.lease("ns", t, store_tokens=0):  # pins both cached window parts
            with pytest.raises(OutOfBlocks, match="asked 3 window parts: 2 free"):
                c.allocate(0, namespace="ns", num_window_blocks=3)
        assert c.stats(check_integrity=True)["integrity"] == "ok"
    with running_server(num_blocks=8) as server, Client(server.socket) as c:
        with pytest.raises(InvalidArgument, match="without a sliding window"):
            c.allocate(1, namespace="ns", num_window_blocks=1)
        with c.lease("ns", prompt(1, 2)) as lease:
            with pytest.raises(InvalidArgument, match="without a sliding window"):
                lease.insert(prompt(1, 2), lease.new_block_ids, window_ids=(3,))


def test_inspector_shows_both_parts() -> None:
    """`radixkv inspect`, `inspect tree` and `events` on a windowed pool: window parts beside
    the blocks (the CLI in a subprocess, as an operator runs it)."""
    def cli(*args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "radixkv", *args, "--socket", server.socket],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout

    with running_server(*WINDOW, "--num-window-blocks", "6", num_blocks=12) as server, \
            Client(server.socket) as c:
        wins = store(c, prompt(1, 5), 1.0)
        summary = json.loads(cli("inspect", "--json"))
        assert summary["window_parts"] == {"total": 6, "free": 4, "cached": 2}
        (node,) = json.loads(cli("inspect", "tree", "ns", "--json"))["children"]
        assert node["window_ids"] == [None, None, None, *wins]
        assert "window parts [...ww]" in cli("inspect", "tree", "ns")
        lines = [json.loads(x) for x in cli("events", "--from", "1", "--count", "2",
                                            "--json").splitlines()]
        assert [e["type"] for e in lines] == ["BlockStored", "WindowStored"]
        assert lines[1]["window_ids"] == list(wins)
        assert lines[1]["block_hashes"] == lines[0]["block_hashes"][3:]
