"""Workload loaders and the synthetic generator."""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import pytest

from radixkv.protocol.errors import InvalidArgument
from radixkv.protocol.tokens import from_token_bytes
from radixkv.replay.workload import (
    MOONCAKE_BLOCK_TOKENS,
    VOCAB_SIZE,
    Request,
    generate_synthetic,
    iter_trace,
    load_mooncake,
    load_token_jsonl,
    load_trace,
    mooncake_tokens,
    write_token_jsonl,
)

TRACES = Path(__file__).parents[2] / ".." / "shared" / "traces"
CONVERSATION = TRACES / "mooncake" / "conversation_trace.jsonl"
needs_conversation = pytest.mark.skipif(
    not CONVERSATION.is_file(),
    reason=f"Mooncake trace not found at {CONVERSATION} (see shared/traces/README.md)",
)


def raw_records(path: Path, n: int) -> list[dict]:
    with path.open() as f:
        return [json.loads(line) for line in islice(f, n)]


@needs_conversation
def test_mooncake_conversion_lengths_and_determinism():
    records = raw_records(CONVERSATION, 200)
    requests = load_mooncake(CONVERSATION, limit=200)
    assert len(requests) == 200
    block_of: dict[int, bytes] = {}
    bb = 4 * MOONCAKE_BLOCK_TOKENS
    for rec, req in zip(records, requests, strict=True):
        assert req.num_tokens == rec["input_length"]
        assert (req.timestamp_ms, req.output_length) == (rec["timestamp"], rec["output_length"])
        assert int(from_token_bytes(req.tokens).max()) < VOCAB_SIZE
        for i, h in enumerate(rec["hash_ids"]):
            block = req.tokens[i * bb : (i + 1) * bb]
            if len(block) == bb:  # same id -> same tokens, wherever it appears
                assert block_of.setdefault(h, block) == block
    assert len(set(block_of.values())) == len(block_of)  # different ids -> different blocks
    assert load_trace(CONVERSATION, limit=200) == requests
    assert list(iter_trace(CONVERSATION, limit=3)) == requests[:3]


def test_mooncake_tokens_cut_the_last_block():
    full = mooncake_tokens([7, 8], 1024)
    assert mooncake_tokens([7, 8], 600) == full[: 600 * 4]
    assert mooncake_tokens([8], 512) == full[2048:]
    with pytest.raises(InvalidArgument, match="input_length 1025 needs 3 hash ids, got 2"):
        mooncake_tokens([7, 8], 1025)


def test_token_jsonl_round_trip(tmp_path: Path):
    requests = generate_synthetic(20, seed=1) + [Request(b"", None, "other", 0)]
    path = tmp_path / "w.jsonl"
    assert write_token_jsonl(requests, path) == 21
    assert load_token_jsonl(path) == requests
    assert load_trace(path, limit=5) == requests[:5]


def test_loader_errors(tmp_path: Path):
    with pytest.raises(InvalidArgument, match="trace file not found"):
        load_trace(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"tokens": [1, 2]}\n{"tokens": [1, -2]}\n')
    with pytest.raises(InvalidArgument, match=r"bad.jsonl:2: bad token record: token 1 is -2"):
        load_trace(bad)
    bad.write_text('{"what": 1}\n')
    with pytest.raises(InvalidArgument, match="neither a Mooncake trace"):
        load_trace(bad)
    bad.write_text("{nope\n")
    with pytest.raises(InvalidArgument, match="bad.jsonl:1: not JSON"):
        load_trace(bad)
    bad.write_text("\n")
    assert load_trace(bad) == []


def test_synthetic_is_deterministic_by_seed_and_shares_prefixes():
    a = generate_synthetic(300, seed=3)
    assert a == generate_synthetic(300, seed=3)
    assert a != generate_synthetic(300, seed=4)
    lengths = [r.num_tokens for r in a]
    assert 1500 < sum(lengths) / len(lengths) < 2500
    stamps = [r.timestamp_ms for r in a]
    assert stamps == sorted(stamps)
    # later turns extend an earlier turn's whole prompt (plus its answer and a new message)
    earlier = {r.tokens for r in a[:150]}
    extending = [
        r for r in a[150:] if any(r.tokens.startswith(p) and r.tokens != p for p in earlier)
    ]
    assert len(extending) > 30
