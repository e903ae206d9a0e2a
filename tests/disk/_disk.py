"""Test helpers for the disk tier against a real server: prompts whose KV is a function of their
tokens (so any block a Match hands out can be checked byte for byte), written by one client and
read back by another process."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from typing import Any

import numpy as np

from radixkv.client import Client

BS = 4  # tests/_server.py's block size
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def prompt(i: int, blocks: int = 2) -> list[int]:
    """Prompt i: `blocks` full blocks of its own tokens."""
    return [1000 * (i + 1) + t for t in range(blocks * BS)]


def block_value(tokens: list[int], position: int) -> float:
    """The KV every element of block `position` of `tokens` holds: a function of its prefix."""
    return float(sum(tokens[:(position + 1) * BS]) % 100_003 + position)


def put(kv: Client, ns: str, tokens: list[int]) -> int:
    """One request: Match, allocate the rest, write the KV function, Insert, release. Returns
    the tokens the Match hit (those blocks' bytes checked)."""
    with kv.lease(ns, tokens) as lease:
        check(lease.view(), lease.block_ids, tokens)
        need = len(tokens) // BS - len(lease.block_ids)
        if need:
            new = lease.allocate(need)
            view = lease.view()
            for j, b in enumerate(new, len(lease.block_ids)):
                view[b] = block_value(tokens, j)
            lease.insert(tokens, list(lease.block_ids) + list(new))
        return int(lease.num_tokens)


def check(view: Any, block_ids: Any, tokens: list[int]) -> None:
    for j, b in enumerate(block_ids):
        got = np.unique(view[b].numpy())
        assert got.tolist() == [block_value(tokens, j)], f"block {j} of {tokens[:2]}: {got}"


READER = """
import json, sys
sys.path.insert(0, {tests!r})
from _disk import check
from radixkv.client import Client
hits = []
with Client({sock!r}) as kv:
    for tokens in json.loads(sys.stdin.read()):
        with kv.lease({ns!r}, tokens) as lease:
            check(lease.view(), lease.block_ids, tokens)
            hits.append(lease.num_tokens)
print(json.dumps(hits))
"""


def read_in_other_process(sock: str, ns: str, prompts: list[list[int]]) -> list[int]:
    """Match every prompt from a second process, checking each hit block's bytes there;
    returns the hit tokens of each."""
    code = READER.format(tests=HERE, sock=sock, ns=ns)
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps(prompts), text=True,
                         capture_output=True, timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr
    hits: list[int] = json.loads(out.stdout)
    return hits


# ---- in process: a KVService over a disk tier, prompts of whole blocks ------------------------

def tokens_of(prompt: tuple[int, ...]) -> bytes:
    """A prompt of one id per block, as BS tokens each."""
    return np.asarray([s * 10 + t for s in prompt for t in range(BS)], "<u4").tobytes()


def kv_of(prefix: tuple[int, ...]) -> np.ndarray:
    """The 128 bytes of the block that ends `prefix` (a function of the whole prefix)."""
    return np.frombuffer(hashlib.sha256(repr(prefix).encode()).digest() * 4, np.uint8)


def hits(svc: Any, pool: Any, ns: str, prompt: tuple[int, ...]) -> int:
    """The blocks a Match of `prompt` hits, each checked byte for byte."""
    m = svc.match("e", ns, tokens_of(prompt))
    try:
        for j, b in enumerate(m.block_ids):
            assert np.array_equal(pool.block_bytes(b), kv_of(prompt[:j + 1])), (prompt, j)
        return len(m.block_ids)
    finally:
        svc.release("e", [m.lease_id])
