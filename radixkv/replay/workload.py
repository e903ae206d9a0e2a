"""Workloads: requests as token bytes, from trace files or a synthetic generator.

Formats:
- Mooncake (FAST'25 traces): `{"timestamp", "input_length", "output_length", "hash_ids"}`; each
  hash id stands for one 512-token block of a prefix chain. Each id becomes a deterministic block
  of 512 pseudo-random token ids (a SplitMix64 hash of id * 512 + position, mod a 128,000 vocab:
  same id -> same tokens, different ids -> different blocks, nothing to cache); the last block is
  cut so the prompt has exactly input_length tokens.
- Token JSONL: `{"tokens": [...], "timestamp"?: ms, "namespace"?: str, "output_length"?: int}`.

`iter_trace` streams (a Mooncake trace expands to ~0.6 GB of tokens); the `load_*` functions
return lists.
"""

from __future__ import annotations

import json
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from radixkv.protocol.errors import InvalidArgument
from radixkv.protocol.tokens import TOKEN_DTYPE, from_token_bytes, num_tokens, to_token_bytes

MOONCAKE_BLOCK_TOKENS = 512
VOCAB_SIZE = 128_000
DEFAULT_NAMESPACE = "default"


@dataclass(frozen=True, slots=True)
class Request:
    tokens: bytes  # little-endian uint32 token ids
    timestamp_ms: float | None
    namespace: str
    output_length: int

    @property
    def num_tokens(self) -> int:
        return num_tokens(self.tokens)


def mooncake_tokens(hash_ids: list[int], input_length: int) -> bytes:
    """The prompt a Mooncake record stands for: 512 tokens per hash id, cut to input_length."""
    if not 0 <= input_length <= len(hash_ids) * MOONCAKE_BLOCK_TOKENS:
        raise InvalidArgument(
            f"input_length {input_length} needs {-(-input_length // MOONCAKE_BLOCK_TOKENS)} "
            f"hash ids, got {len(hash_ids)}"
        )
    ids = np.asarray(hash_ids, dtype=np.uint64)
    pos = np.arange(MOONCAKE_BLOCK_TOKENS, dtype=np.uint64)
    x = (ids[:, None] * np.uint64(MOONCAKE_BLOCK_TOKENS) + pos).ravel()[:input_length]
    x += np.uint64(0x9E3779B97F4A7C15)  # SplitMix64 finalizer; uint64 arrays wrap silently
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return (x % np.uint64(VOCAB_SIZE)).astype(TOKEN_DTYPE).tobytes()


def _records(path: str | Path) -> Generator[tuple[int, dict[str, Any]], None, None]:
    path = Path(path)
    if not path.is_file():
        raise InvalidArgument(f"trace file not found: {path}")
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as e:
                    raise InvalidArgument(f"{path}:{lineno}: not JSON: {e}") from None


def _mooncake(path: str | Path) -> Iterator[Request]:
    for lineno, rec in _records(path):
        try:
            tokens = mooncake_tokens(rec["hash_ids"], int(rec["input_length"]))
            out = int(rec.get("output_length", 0))
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidArgument(f"{path}:{lineno}: bad Mooncake record: {e!r}") from None
        ts = rec.get("timestamp")
        yield Request(tokens, None if ts is None else float(ts), DEFAULT_NAMESPACE, out)


def _token_jsonl(path: str | Path) -> Iterator[Request]:
    for lineno, rec in _records(path):
        try:
            tokens = to_token_bytes(rec["tokens"])
            ts = rec.get("timestamp")
            req = Request(
                tokens,
                None if ts is None else float(ts),
                str(rec.get("namespace", DEFAULT_NAMESPACE)),
                int(rec.get("output_length", 0)),
            )
        except (KeyError, TypeError, ValueError) as e:  # InvalidArgument is a ValueError
            raise InvalidArgument(f"{path}:{lineno}: bad token record: {e}") from None
        yield req


def iter_trace(path: str | Path, limit: int | None = None) -> Iterator[Request]:
    """Stream requests from a Mooncake or token JSONL file, told apart by the first record."""
    records = _records(path)
    first = next(records, None)
    records.close()
    if first is None:
        return iter(())
    if "hash_ids" in first[1]:
        return islice(_mooncake(path), limit)
    if "tokens" in first[1]:
        return islice(_token_jsonl(path), limit)
    raise InvalidArgument(f"{path}: neither a Mooncake trace (hash_ids) nor token JSONL (tokens)")


def load_trace(path: str | Path, limit: int | None = None) -> list[Request]:
    return list(iter_trace(path, limit))


def load_mooncake(path: str | Path, limit: int | None = None) -> list[Request]:
    return list(islice(_mooncake(path), limit))


def load_token_jsonl(path: str | Path, limit: int | None = None) -> list[Request]:
    return list(islice(_token_jsonl(path), limit))


def write_token_jsonl(requests: Iterable[Request], path: str | Path) -> int:
    """Write requests as token JSONL; returns how many."""
    n = 0
    with Path(path).open("w") as f:
        for r in requests:
            rec: dict[str, Any] = {"tokens": from_token_bytes(r.tokens).tolist()}
            if r.timestamp_ms is not None:
                rec["timestamp"] = r.timestamp_ms
            rec["namespace"] = r.namespace
            rec["output_length"] = r.output_length
            f.write(json.dumps(rec, separators=(",", ":")) + "\n")
            n += 1
    return n


def generate_synthetic(
    num_requests: int,
    seed: int = 0,
    *,
    num_system_prompts: int = 4,
    system_prompt_tokens: int = 1200,
    user_tokens: int = 250,
    answer_tokens: int = 150,
    max_turns: int = 5,
    num_active: int = 32,
    requests_per_s: float = 10.0,
    namespace: str = DEFAULT_NAMESPACE,
) -> list[Request]:
    """Chat-like traffic with prefix sharing, deterministic for a seed.

    A few shared system prompts; `num_active` conversations in flight, each request continuing a
    random one (a finished one is replaced by a new conversation of 1..max_turns turns on a random
    system prompt). Turn k's prompt is turn k-1's prompt + its answer (output_length tokens) + a
    new unique user message. Lengths are uniform in [0.5, 1.5] x their mean ([0.9, 1.1] for
    system prompts): prompts average ~2,000 tokens with the defaults. Arrivals are Poisson at
    `requests_per_s`.
    """
    if num_requests < 0 or num_system_prompts < 1 or num_active < 1 or max_turns < 1:
        raise InvalidArgument(
            "num_requests >= 0 and num_system_prompts, num_active, max_turns >= 1"
        )
    rng = np.random.default_rng(seed)

    def tokens(mean: int, spread: float = 0.5) -> bytes:
        n = int(rng.integers(int(mean * (1 - spread)), int(mean * (1 + spread)) + 1))
        return rng.integers(0, VOCAB_SIZE, n, dtype=np.uint32).astype(TOKEN_DTYPE).tobytes()

    systems = [tokens(system_prompt_tokens, 0.1) for _ in range(num_system_prompts)]
    slots: list[tuple[bytes, int] | None] = [None] * num_active  # (history, turns left)
    gaps = rng.exponential(1000.0 / requests_per_s, num_requests)
    now, out = 0.0, []
    for gap in gaps:
        now += float(gap)
        i = int(rng.integers(num_active))
        slot = slots[i]
        if slot is None:
            slot = (
                systems[int(rng.integers(num_system_prompts))],
                int(rng.integers(max_turns)) + 1,
            )
        history, turns_left = slot
        prompt = history + tokens(user_tokens)
        answer = tokens(answer_tokens)
        out.append(Request(prompt, round(now, 3), namespace, num_tokens(answer)))
        slots[i] = (prompt + answer, turns_left - 1) if turns_left > 1 else None
    return out
