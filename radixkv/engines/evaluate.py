"""Accuracy of KV that went through the pool: perplexity of the real model over the pydoc corpus
when the KV of the first part of every window is read from radixkv (written there by another
process), against the model computing the whole window itself.

    window   |<------------------------- context tokens -------------------------->|
             |<--- cached part: written by the writer --->|<--- scored part --------->|
    writer   (another process) prefill(cached part) -> its full blocks into the pool
    reader   Match -> gather -> forward(scored part) on that KV -> hidden states
    model    forward(whole window) itself -> hidden states
    both     LM head in chunks over the scored positions -> NLL of the next token, logits diff

The cached part is `cached_fraction` of the window rounded down to whole blocks. Both sides
score the same predictions (positions cached..context-2 predicting the token after), so
ppl_pool - ppl_reference measures only what the pool did to the KV. With fp32 KV the bytes are
copied exactly and the only difference is float rounding in the suffix attention.

A row per (kv format, context). KV_FORMATS names each format's `radixkv serve` flags: fp32 (the
model's own dtype, copied), int8, and int4 with the three techniques of the quantization
literature off ("int4-naive": per-token scales per head, no sinks), one at a time, and all on
("int4"). Besides perplexity a row has the mean KL divergence of the next-token distributions,
top-1 agreement, and per-layer signal-to-noise of the keys and values read from the pool.
"""

from __future__ import annotations

import math
import multiprocessing
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from radixkv.protocol.errors import InvalidArgument

# format -> `radixkv serve` flags (on top of the model's layout, --dtype fp32)
KV_FORMATS: dict[str, tuple[str, ...]] = {
    "fp32": (),
    "int8": ("--kv-dtype", "int8"),
    "int4-naive": ("--kv-dtype", "int4", "--kv-key-scales", "token", "--kv-sink-tokens", "0"),
    "int4-group32": ("--kv-dtype", "int4", "--kv-key-scales", "token", "--kv-group-size", "32",
                     "--kv-sink-tokens", "0"),
    "int4-kchannel": ("--kv-dtype", "int4", "--kv-sink-tokens", "0"),
    "int4-sinks": ("--kv-dtype", "int4", "--kv-key-scales", "token"),
    "int4": ("--kv-dtype", "int4", "--kv-group-size", "32"),
}
KV_DTYPES = tuple(KV_FORMATS)
DEFAULT_CONTEXTS = (512, 2048, 8192)
LOGIT_CHUNK = 512  # positions per LM-head call: 512 x 49,152 fp32 logits = 96 MiB


@dataclass(frozen=True, slots=True)
class AccuracyRow:
    """One (kv dtype, context) measurement over `windows` windows of the corpus."""

    kv_dtype: str
    context: int
    windows: int
    cached_tokens: int  # per window, read from the pool
    scored_tokens: int  # predictions scored, all windows
    ppl_reference: float  # the model alone
    ppl_pool: float  # the cached part's KV from the pool
    delta_ppl_pct: float  # (ppl_pool - ppl_reference) / ppl_reference x 100
    max_abs_logit_diff: float  # over every scored position and vocabulary entry
    seconds: float
    kl_mean: float = 0.0  # mean KL(reference || pool) of the next-token distributions
    top1_agree: float = 1.0  # share of scored positions whose argmax agrees
    k_snr_db: tuple[float | None, ...] = ()  # per layer, pool's K vs the model's (None: exact)
    v_snr_db: tuple[float | None, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_kv_dtype(kv_dtype: str) -> None:
    if kv_dtype not in KV_FORMATS:
        raise InvalidArgument(f"kv format {kv_dtype!r} is not one of {', '.join(KV_FORMATS)}")


def corpus_windows(tokens: Sequence[int], context: int, count: int) -> list[list[int]]:
    """`count` consecutive, non-overlapping windows of `context` tokens from the start."""
    if context < 2:
        raise InvalidArgument(f"context must be at least 2 tokens, got {context}")
    if count * context > len(tokens):
        raise InvalidArgument(f"{count} windows of {context} tokens need {count * context} "
                              f"tokens; the corpus has {len(tokens)}")
    return [list(tokens[i * context:(i + 1) * context]) for i in range(count)]


def cached_length(context: int, block_size: int, cached_fraction: float) -> int:
    """Tokens of a window whose KV comes from the pool: whole blocks, at least one token left
    to compute."""
    cached = int(context * cached_fraction) // block_size * block_size
    return min(cached, (context - 1) // block_size * block_size)


# ---- the writer: another engine process -----------------------------------------------------

_writer: Any = None  # this process's Engine


def _init_writer(socket_path: str, model: str, namespace: str) -> None:
    from radixkv.engines import models
    from radixkv.engines.hf import Engine

    global _writer
    _writer = Engine(models.load(model).model, socket_path, namespace)


def _write(tokens: list[int]) -> int:
    """Prefill `tokens` through radixkv (storing their full blocks); returns tokens cached."""
    assert _writer is not None, "the writer was not initialized"
    _writer.prefill(tokens)
    block_size: int = _writer.layout.block_size
    return len(tokens) // block_size * block_size


class PoolWriter:
    """An engine in a spawned process that writes prompts' KV into the pool."""

    def __init__(self, socket_path: str, model: str, namespace: str) -> None:
        ctx = multiprocessing.get_context("spawn")  # torch and gRPC are not fork-safe
        self._pool = ProcessPoolExecutor(1, mp_context=ctx, initializer=_init_writer,
                                         initargs=(socket_path, model, namespace))

    def write(self, tokens: list[int]) -> int:
        return int(self._pool.submit(_write, tokens).result())

    def close(self) -> None:
        self._pool.shutdown()

    def __enter__(self) -> PoolWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- the measurement ------------------------------------------------------------------------

@dataclass(slots=True)
class _Scores:
    nll_ref: float = 0.0
    nll_pool: float = 0.0
    diff: float = 0.0
    kl: float = 0.0
    agree: int = 0
    scored: int = 0
    # per layer: sum of squares of the model's K (V), and of the pool's error
    k_signal: Any = 0.0
    k_noise: Any = 0.0
    v_signal: Any = 0.0
    v_noise: Any = 0.0


_REFERENCE: dict[tuple[int, int], tuple[Any, Any, Any]] = {}  # the model alone, per window


def _reference(engine: Any, window: list[int], cached: int) -> tuple[Any, Any, Any]:
    """The model alone on `window`: hidden states of the scored positions and the K, V of the
    cached part ([layers, tokens, heads, dim]). Kept for the next format (same window)."""
    import torch

    key = (hash(tuple(window)), cached)
    if key not in _REFERENCE:
        from radixkv.engines.hf import cache_layers

        if len(_REFERENCE) >= 32:
            _REFERENCE.clear()
        ref = engine.prefill_no_cache(window, return_hidden=True)
        layers = cache_layers(ref.cache)
        k = torch.stack([a[0, :, :cached].transpose(0, 1) for a, _ in layers])
        v = torch.stack([b[0, :, :cached].transpose(0, 1) for _, b in layers])
        _REFERENCE[key] = (ref.hidden[cached:-1].clone(), k, v)
    return _REFERENCE[key]


def score_window(engine: Any, window: list[int], cached: int, into: _Scores) -> None:
    """Read `window` with its first `cached` tokens' KV from the pool (written before), and
    compare with the model computing it whole: NLLs, logit difference, KL, top-1, and the
    per-layer error of the K and V read from the pool, added to `into`."""
    import torch
    import torch.nn.functional as F

    from radixkv.engines.hf import cache_layers

    with torch.inference_mode():
        got = engine.prefill(window, store=False, return_hidden=True)
        if got.cached_tokens != cached:
            raise RuntimeError(f"expected {cached} tokens of the window from the pool, matched "
                               f"{got.cached_tokens} (evicted? give the pool more blocks)")
        pool_hidden = got.hidden[:-1]  # positions cached .. end-2
        ref_hidden, ref_k, ref_v = _reference(engine, window, cached)
        layers = cache_layers(got.cache)
        k = torch.stack([a[0, :, :cached].transpose(0, 1) for a, _ in layers]).float()
        v = torch.stack([b[0, :, :cached].transpose(0, 1) for _, b in layers]).float()
        del got, layers
        into.k_signal = into.k_signal + ref_k.float().pow(2).sum((1, 2, 3))
        into.k_noise = into.k_noise + (k - ref_k).pow(2).sum((1, 2, 3))
        into.v_signal = into.v_signal + ref_v.float().pow(2).sum((1, 2, 3))
        into.v_noise = into.v_noise + (v - ref_v).pow(2).sum((1, 2, 3))
        targets = torch.tensor(window[cached + 1:], device=pool_hidden.device)
        for start in range(0, len(targets), LOGIT_CHUNK):
            end = start + LOGIT_CHUNK
            logits_ref = engine.logits(ref_hidden[start:end])
            logits_pool = engine.logits(pool_hidden[start:end])
            into.diff = max(into.diff, float((logits_ref - logits_pool).abs().max()))
            into.nll_ref += float(F.cross_entropy(logits_ref, targets[start:end],
                                                  reduction="sum"))
            into.nll_pool += float(F.cross_entropy(logits_pool, targets[start:end],
                                                   reduction="sum"))
            log_ref, log_pool = F.log_softmax(logits_ref, -1), F.log_softmax(logits_pool, -1)
            into.kl += float((log_ref.exp() * (log_ref - log_pool)).sum())
            into.agree += int((logits_ref.argmax(-1) == logits_pool.argmax(-1)).sum())
        into.scored += len(targets)


def _snr(signal: Any, noise: Any) -> tuple[float | None, ...]:
    """Per layer, in dB (None where the pool's copy is exact)."""
    return tuple(10 * math.log10(float(s) / float(n)) if float(n) > 0 else None
                 for s, n in zip(signal, noise, strict=True))


def evaluate(engine: Any, writer: Callable[[list[int]], int], tokens: Sequence[int],
             kv_dtype: str, context: int, windows: int, cached_fraction: float = 0.5,
             progress: Callable[[str], None] | None = None) -> AccuracyRow:
    """One row: `windows` windows of `context` tokens; `writer(tokens)` puts a window's cached
    part into the pool (another process), `engine` (connected to the same service and
    namespace) reads it back."""
    check_kv_dtype(kv_dtype)
    t0 = time.perf_counter()
    cached = cached_length(context, engine.layout.block_size, cached_fraction)
    sc = _Scores()
    for i, window in enumerate(corpus_windows(tokens, context, windows)):
        written = writer(window[:cached])
        if written != cached:
            raise RuntimeError(f"the writer cached {written} tokens, expected {cached}")
        score_window(engine, window, cached, sc)
        if progress:
            progress(f"{kv_dtype} context {context}: window {i + 1}/{windows}, "
                     f"{time.perf_counter() - t0:.0f} s")
    ppl_ref, ppl_pool = math.exp(sc.nll_ref / sc.scored), math.exp(sc.nll_pool / sc.scored)
    return AccuracyRow(kv_dtype, context, windows, cached, sc.scored, ppl_ref, ppl_pool,
                       (ppl_pool - ppl_ref) / ppl_ref * 100, sc.diff, time.perf_counter() - t0,
                       sc.kl / sc.scored, sc.agree / sc.scored, _snr(sc.k_signal, sc.k_noise),
                       _snr(sc.v_signal, sc.v_noise))


def default_windows(context: int, span: int = 8192) -> int:
    """Windows per context so that every context covers the same `span` corpus tokens."""
    return max(1, span // context)


def run_accuracy(socket_path: str, loaded: Any, kv_dtype: str, contexts: Sequence[int],
                 windows: int | None = None, cached_fraction: float = 0.5,
                 progress: Callable[[str], None] | None = None) -> list[AccuracyRow]:
    """Rows for one kv dtype against the service at `socket_path` (its pool must store that
    dtype in the model's layout). `loaded` (radixkv.engines.models.LoadedModel) reads here;
    a spawned process loads the same model and writes. `windows`: per context (default: as
    many as cover 8,192 tokens)."""
    from radixkv.engines import corpus
    from radixkv.engines.hf import Engine

    check_kv_dtype(kv_dtype)
    limit = loaded.config.get("max_position_embeddings", sys.maxsize)
    if max(contexts) > limit:
        raise InvalidArgument(f"context {max(contexts)} is longer than the model's {limit}")
    tokens = corpus.tokens(loaded.tokenizer)
    namespace = f"{loaded.namespace}/accuracy"
    engine = Engine(loaded.model, socket_path, namespace)
    rows = []
    try:
        with PoolWriter(socket_path, loaded.spec.name, namespace) as writer:
            for context in contexts:
                rows.append(evaluate(engine, writer.write, tokens, kv_dtype, context,
                                     windows or default_windows(context), cached_fraction,
                                     progress))
    finally:
        engine.close()
    return rows
