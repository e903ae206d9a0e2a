"""replay_tree against an independent per-block reference over Mooncake hash-id chains.

With block_size 512 every full 512-token block of a Mooncake prompt is exactly one hash id, and
the ids are prefix-chained, so a radix tree over tokens and a set of cached hash ids are the same
cache. The reference keeps one entry per id (no edges, no splits), evicts childless unlocked ids
in policy order one block at a time, and follows the replay contract of
radixkv.replay.simulate: lock touches the matched ids, evict what the free room lacks, insert
what fits and touch the whole path. Counting only full blocks (the first input_length // 512
ids; a partial block is never cached), the per-request hit tokens must be exactly 512 x the
reference's matched ids.
"""

from __future__ import annotations

import json
from collections import Counter
from itertools import islice
from pathlib import Path

import pytest

from radixkv.protocol.errors import InvalidArgument
from radixkv.replay.simulate import replay_tree
from radixkv.replay.workload import Request, generate_synthetic, load_mooncake

TRACES = Path(__file__).parents[2] / ".." / "shared" / "traces"
CONVERSATION = TRACES / "mooncake" / "conversation_trace.jsonl"
NUM_REQUESTS = 300


def reference_matched_blocks(records: list[dict], capacity: int, policy: str) -> list[int]:
    cached: dict[int, int | None] = {}  # id -> parent id
    num_children: Counter[int] = Counter()
    last: dict[int, int] = {}
    hits: Counter[int] = Counter()
    tick = 0
    out = []
    for rec in records:
        ids = rec["hash_ids"][: rec["input_length"] // 512]
        m = 0
        while m < len(ids) and ids[m] in cached:
            m += 1
        out.append(m)
        tick += 1
        for h in ids[:m]:  # lock: touch and count a hit
            last[h] = tick
            hits[h] += 1
        locked = set(ids[:m])
        need = len(ids) - m
        for _ in range(need - (capacity - len(cached))):
            leaves = [h for h in cached if not num_children[h] and h not in locked]
            if not leaves:
                break
            key = (lambda h: last[h]) if policy == "lru" else (lambda h: (hits[h], last[h]))
            victim = min(leaves, key=key)
            parent = cached.pop(victim)
            if parent is not None:
                num_children[parent] -= 1
        take = min(need, capacity - len(cached))
        tick += 1
        for i in range(m, m + take):
            parent = ids[i - 1] if i else None
            cached[ids[i]] = parent
            if parent is not None:
                num_children[parent] += 1
        for h in ids[: m + take]:  # insert touches the whole path
            last[h] = tick
    return out


@pytest.fixture(scope="module")
def conversation() -> tuple[list[dict], list[Request]]:
    if not CONVERSATION.is_file():
        pytest.skip(f"Mooncake trace not found at {CONVERSATION} (see shared/traces/README.md)")
    with CONVERSATION.open() as f:
        records = [json.loads(line) for line in islice(f, NUM_REQUESTS)]
    return records, load_mooncake(CONVERSATION, limit=NUM_REQUESTS)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("capacity", [40, 400, 2000, 10**6])
def test_replay_matches_the_hash_id_reference_exactly(conversation, capacity, policy):
    records, requests = conversation
    result = replay_tree(requests, 512, capacity, policy, keep_per_request=True)
    expected = reference_matched_blocks(records, capacity, policy)
    assert result.per_request_hit_tokens == tuple(512 * m for m in expected)
    assert result.hit_tokens == 512 * sum(expected)
    assert result.prompt_tokens == sum(r["input_length"] for r in records)
    assert result.cacheable_tokens == 512 * sum(r["input_length"] // 512 for r in records)
    assert result.peak_cached_blocks <= capacity
    if capacity == 10**6:  # infinite: a full block hits iff its id appeared before
        seen: set[int] = set()
        ideal = 0
        for r in records:
            full = r["hash_ids"][: r["input_length"] // 512]
            ideal += sum(h in seen for h in full)
            seen.update(full)
        assert result.hit_tokens == 512 * ideal
        assert result.num_evicted_blocks == 0


def test_replay_sanity_on_synthetic():
    requests = generate_synthetic(150, seed=5)
    a = replay_tree(requests, 16, 2000)
    b = replay_tree(requests, 16, 2000)  # timings differ between runs, counts do not
    assert (a.hit_tokens, a.num_evicted_blocks) == (b.hit_tokens, b.num_evicted_blocks)
    assert 0.3 < a.token_hit_rate < 1
    assert a.num_requests == 150 and a.match_us.p50 > 0
    none = replay_tree(requests, 16, 0)
    assert none.hit_tokens == 0
    assert none.num_dropped_blocks == none.cacheable_tokens // 16


def test_replay_rejects_mixed_namespaces():
    reqs = [Request(b"\x00" * 64, None, "a", 0), Request(b"\x00" * 64, None, "b", 0)]
    with pytest.raises(InvalidArgument, match="one namespace"):
        replay_tree(reqs, 4, 10)
