"""Sliding-window models through the engine (radixkv.engines.window_cache, Engine's windowed
path): a cache rebuilt from the full layers' KV of [0, p) and the windowed layers' KV of the last
blocks only gives the logits of the model's own no-cache run, for three shapes:

    mistral   tiny MistralForCausalLM, every layer windowed, W 9 (W - 1 a multiple of the block:
              the fully cached prompt matches without its last token), attention "radixkv"
    gemma2    tiny Gemma2ForCausalLM, alternating windowed / full layers, W 10, eager attention
    smollm2   the real SmolLM2-135M weights in a MinistralForCausalLM with a window (layer_types)

Tolerance as tests/engines/test_engine_hf.py: logits within atol 1e-4 (rtol 0) of the no-cache run
(measured: identical or within 3e-7). KV outside a windowed layer's window is proved unused:
garbage there changes no bit (and garbage one position later does).

The engine's windowed path runs against a real `radixkv serve` of each model's config (its
window read from it): full and window parts allocated, written and read through the shared pool.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

import torch  # noqa: E402

from kvpool.layout import KVLayout  # noqa: E402
from radixkv.client.client import Client  # noqa: E402
from radixkv.engines import attention, tiny_llama  # noqa: E402
from radixkv.engines.hf import Engine, PrefillResult, pool_layout_for  # noqa: E402
from radixkv.engines.window_cache import (  # noqa: E402
    build_cache,
    cache_layers,
    extract,
    match_length,
    resume_point,
    stored_window_blocks,
    window_start,
)
from radixkv.protocol.errors import FailedPrecondition, InvalidArgument  # noqa: E402
from radixkv.protocol.limits import HOLE  # noqa: E402
from radixkv.server.launch import start_server  # noqa: E402

ATOL = 1e-4
BLOCK_SIZE = 4
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}


def fill_weights(model: Any, seed: int) -> Any:
    """Seeded N(0, 0.02) weights (norms at their identity: 1, or 0 for Gemma's 1 + w)."""
    gen = torch.Generator().manual_seed(seed)
    unit = 0.0 if model.config.model_type == "gemma2" else 1.0
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(unit)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    return model.eval()


def make_mistral(attn: str = "radixkv") -> Any:
    from transformers import MistralConfig, MistralForCausalLM

    attention.register()
    config = MistralConfig(**TINY, num_hidden_layers=2, sliding_window=9)
    config._attn_implementation = attn
    return fill_weights(MistralForCausalLM(config), seed=0)


def make_gemma2() -> Any:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(**TINY, num_hidden_layers=4, sliding_window=10,
                          query_pre_attn_scalar=16, attn_logit_softcapping=None,
                          final_logit_softcapping=None)  # the engine runs the LM head itself
    config._attn_implementation = "eager"  # Gemma-2 has no sdpa in transformers
    return fill_weights(Gemma2ForCausalLM(config), seed=0)


def with_window(model: Any, window: int, pattern: str) -> Any:
    """`model` (a LlamaForCausalLM) as a MinistralForCausalLM (Llama's layers plus a sliding
    window on layer_types) sharing its weights: the same model, windowed."""
    from transformers import MinistralConfig, MinistralForCausalLM

    from kvpool.window import parse_window_layers

    cfg = model.config
    windowed = set(parse_window_layers(pattern, cfg.num_hidden_layers))
    config = MinistralConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        hidden_act=cfg.hidden_act, max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings,
        rope_parameters=cfg.rope_parameters, sliding_window=window,
        layer_types=["sliding_attention" if i in windowed else "full_attention"
                     for i in range(cfg.num_hidden_layers)])
    config._attn_implementation = cfg._attn_implementation
    with torch.device("meta"):
        windowed_model = MinistralForCausalLM(config)
    windowed_model.load_state_dict(model.state_dict(), assign=True, strict=True)
    windowed_model.model.rotary_emb = model.model.rotary_emb  # a buffer, not in the state
    windowed_model.tie_weights()
    return windowed_model.eval()


def layout_of(model: Any, block_size: int = BLOCK_SIZE) -> KVLayout:
    return pool_layout_for(model.config, block_size, "fp32")


def make_tokens(n: int, seed: int, vocab: int = TINY["vocab_size"]) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


@torch.inference_mode()
def logits_from(model: Any, tokens: list[int], p: int, cache: Any) -> torch.Tensor:
    """The model's logits of positions p.. run on top of `cache` (positions [0, p))."""
    ids = torch.tensor([tokens[p:]])
    positions = torch.arange(p, len(tokens)).unsqueeze(0)
    out: torch.Tensor = model(input_ids=ids, position_ids=positions, cache=cache,
                              use_cache=True).logits[0]
    return out


@torch.inference_mode()
def no_cache(model: Any, tokens: list[int]) -> tuple[torch.Tensor, Any]:
    """The model's own run over the whole prompt: logits of every position, and the KV of every
    position of every layer (a plain DynamicCache: Engine._new_cache for windowed models)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    return logits_from(model, tokens, 0, cache), cache


def resume(model: Any, tokens: list[int], matched_blocks: int, garbage: int | None = None,
           block_size: int = BLOCK_SIZE) -> tuple[int, torch.Tensor]:
    """Resume `tokens` from what a windowed pool hands out for `matched_blocks` blocks: full
    parts of them all, window parts of the last `window_blocks` (both from the no-cache run).
    `garbage`: the windowed layers' positions before window_start + garbage filled with 1e4."""
    layout = layout_of(model, block_size)
    _, full_run = no_cache(model, tokens)
    pool = extract(layout, full_run, 0, matched_blocks)
    p = resume_point(matched_blocks * block_size, len(tokens))
    cache = build_cache(layout, p, pool.full_k, pool.full_v, pool.window_k, pool.window_v,
                        pool.window_first_block * block_size)
    if garbage is not None and p:
        for i in layout.window_layers:
            for x in cache_layers(cache)[i]:
                x[:, :, :window_start(layout, p) + garbage] = 1e4
    return p, logits_from(model, tokens, p, cache)


@contextlib.contextmanager
def served(model: Any, block_size: int = BLOCK_SIZE, *flags: str) -> Iterator[Client]:
    """A real `radixkv serve` of `model`'s config (its window included; or a config dict) on a
    temp socket, fp32, 256 full parts and 64 window parts (or `flags`), and a client of it."""
    with tempfile.TemporaryDirectory(prefix="rkv-win-") as directory:
        path = os.path.join(directory, "config.json")
        if isinstance(model, dict):
            with open(path, "w") as f:
                json.dump(model, f)
        else:
            model.config.to_json_file(path)
        sock = os.path.join(directory, "s.sock")
        server = start_server(sock, "--model-config", directory, "--dtype", "fp32",
                              "--block-size", str(block_size), "--num-blocks", "256",
                              *(flags or ("--num-window-blocks", "64")))
        try:
            with Client(sock) as client:
                yield client
        finally:
            assert server.stop() == 0, server.output()


def window_positions(client: Client, namespace: str = "ns") -> list[int]:
    """The cached blocks (by index from the root) that hold a window part."""
    nodes, _ = client.dump_tree(namespace)
    out = []
    for n in nodes:
        first = n.depth_tokens // BLOCK_SIZE - len(n.block_ids)
        out += [first + j for j, w in enumerate(n.window_ids) if w != HOLE]
    return sorted(out)


def assert_same_as_recompute(engine: Engine, tokens: list[int], got: PrefillResult) -> None:
    base = engine.prefill_no_cache(tokens)
    torch.testing.assert_close(got.logits_last, base.logits_last, atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def tiny_models() -> dict[str, Any]:
    return {"mistral": make_mistral(), "gemma2": make_gemma2()}


# ---- the cache: build, extract --------------------------------------------------------------

def test_layouts_of_the_windowed_models(tiny_models: dict[str, Any]) -> None:
    mistral, gemma2 = layout_of(tiny_models["mistral"]), layout_of(tiny_models["gemma2"])
    assert (mistral.sliding_window, mistral.window_pattern, mistral.window_blocks) == (
        9, "all", 2)
    assert (gemma2.sliding_window, gemma2.window_layers, gemma2.full_layers,
            gemma2.window_blocks) == (10, (0, 2), (1, 3), 3)


@pytest.mark.parametrize("shape", ["mistral", "gemma2"])
@pytest.mark.parametrize("n, matched_blocks, p", [
    (41, 0, 0),    # nothing cached
    (41, 1, 4),    # p < W: the window reaches position 0
    (41, 2, 8),
    (41, 5, 20),   # p > W: the windowed layers' first 11-12 positions are not in the pool
    (41, 10, 40),  # fully cached: one token computed
    (40, 9, 36),   # block-aligned prompt, resumed one block back
])
def test_resumed_logits_equal_the_no_cache_run(tiny_models: dict[str, Any], shape: str, n: int,
                                               matched_blocks: int, p: int) -> None:
    model = tiny_models[shape]
    tokens = make_tokens(n, seed=n)
    want, _ = no_cache(model, tokens)
    got_p, got = resume(model, tokens, matched_blocks)
    assert got_p == p
    torch.testing.assert_close(got, want[p:], atol=ATOL, rtol=0)
    _, with_garbage = resume(model, tokens, matched_blocks, garbage=0)
    assert torch.equal(with_garbage, got)  # out-of-window KV is never read
    if p > 9:  # the window's first position is read: the test sees garbage where it is read
        _, one_more = resume(model, tokens, matched_blocks, garbage=1)
        assert not torch.allclose(one_more[0], got[0], atol=ATOL, rtol=0)


def test_a_fully_cached_block_aligned_prompt_is_matched_without_its_last_token(
        tiny_models: dict[str, Any]) -> None:
    mistral, gemma2 = layout_of(tiny_models["mistral"]), layout_of(tiny_models["gemma2"])
    # mistral: W 9, 2 window blocks = 8 positions; resuming at 39 needs 31-38, the window
    # parts of blocks 8-9 are 32-39
    assert [match_length(mistral, n) for n in (39, 40, 41)] == [39, 39, 41]
    assert [match_length(gemma2, n) for n in (39, 40, 41)] == [39, 40, 41]  # 12 >= W
    model = tiny_models["gemma2"]
    tokens = make_tokens(40, seed=3)
    p, got = resume(model, tokens, 10)  # W 10, 3 window blocks: 39 resumes from 30-38
    assert p == 39
    torch.testing.assert_close(got, no_cache(model, tokens)[0][39:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("first_block, end_block", [(0, 10), (3, 10), (9, 10), (7, 7)])
def test_extract_takes_full_parts_of_every_block_and_window_parts_of_the_last(
        tiny_models: dict[str, Any], first_block: int, end_block: int) -> None:
    model = tiny_models["gemma2"]  # layers 0, 2 windowed (3 window blocks), 1, 3 full
    layout = layout_of(model)
    _, run = no_cache(model, make_tokens(41, seed=5))
    got = extract(layout, run, first_block, end_block)
    window_first = max(first_block, end_block - 3)
    assert (got.first_block, got.window_first_block, got.end_block) == (
        first_block, window_first, end_block)
    layers = cache_layers(run)
    for part, which, first in ((got.full_k, (1, 3), first_block),
                               (got.window_k, (0, 2), window_first)):
        assert part.shape == (2, (end_block - first) * BLOCK_SIZE, 2, 16)
        for i, layer in enumerate(which):  # pool layout [layers, tokens, kv_heads, head_dim]
            want = layers[layer][0][0, :, first * BLOCK_SIZE:end_block * BLOCK_SIZE]
            assert torch.equal(part[i], want.transpose(0, 1))
    # round trip: a cache built from the extracted parts holds the run's KV where it is read
    p = end_block * BLOCK_SIZE
    whole = extract(layout, run, 0, end_block)
    cache = build_cache(layout, p, whole.full_k, whole.full_v, whole.window_k, whole.window_v,
                        whole.window_first_block * BLOCK_SIZE)
    zeros = whole.window_first_block * BLOCK_SIZE  # windowed layers: nothing from the pool
    for layer, ((k, v), (rk, rv)) in enumerate(zip(cache_layers(cache), layers, strict=True)):
        start = zeros if layer in layout.window_layers else 0
        assert k.shape[2] == v.shape[2] == p
        assert torch.equal(k[:, :, start:], rk[:, :, start:p])
        assert torch.equal(v[:, :, start:], rv[:, :, start:p])
        assert not k[:, :, :start].any() and not v[:, :, :start].any()


def test_build_cache_refuses_kv_that_does_not_cover_the_window(
        tiny_models: dict[str, Any]) -> None:
    layout = layout_of(tiny_models["gemma2"])
    _, run = no_cache(tiny_models["gemma2"], make_tokens(41, seed=6))
    parts = extract(layout, run, 0, 6)  # window parts of blocks 3-5: positions 12-23
    with pytest.raises(ValueError, match=r"positions 16-27; resuming at 24 needs 15-23"):
        build_cache(layout, 24, parts.full_k, parts.full_v, parts.window_k, parts.window_v, 16)
    with pytest.raises(ValueError, match=r"2 full and 2 windowed layers"):
        build_cache(layout, 24, parts.window_k, parts.window_v, parts.full_k[:1],
                    parts.full_v[:1], 12)
    with pytest.raises(ValueError, match=r"from a cache of 41 positions"):
        extract(layout, run, 0, 11)


# ---- the engine on a sliding-window pool ----------------------------------------------------

@pytest.mark.parametrize("shape", ["mistral", "gemma2"])
def test_the_engine_reuses_window_parts_and_matches_a_recompute(tiny_models: dict[str, Any],
                                                                shape: str) -> None:
    model = tiny_models[shape]
    layout = layout_of(model)
    with served(model) as svc:
        reuses_window_parts(Engine(model, svc, "ns"), svc, layout, shape)


def reuses_window_parts(engine: Engine, svc: Client, layout: KVLayout, shape: str) -> None:
    tail = stored_window_blocks(layout)  # mistral 3 (W 9: one more than window_blocks), gemma2 3

    def check(tokens: list[int], cached: int) -> None:
        got = engine.prefill(tokens)
        assert got.cached_tokens == cached
        assert_same_as_recompute(engine, tokens, got)

    system = make_tokens(40, seed=11)  # 10 blocks
    check(system, 0)  # p = 0
    assert window_positions(svc) == list(range(10 - tail, 10))  # the last blocks' only
    # fully cached, block-aligned: W 10 resumes at 39; W 9 (window parts of 8 positions) is
    # matched without its last token and resumes a block back from the extra window part
    check(system, 36 if shape == "mistral" else 39)
    check(system + make_tokens(9, seed=12), 40)  # branches at the window's end: p > W
    assert window_positions(svc)[-2:] == [10, 11]  # only new blocks get parts: 10-11
    # branches 10 tokens before the system prompt's end, outside its stored window: the full
    # parts of blocks 0-6 match but no window parts: nothing reused, nothing wrong
    check(system[:30] + make_tokens(11, seed=13), 0)
    # ... but that request stored the window parts before the branch point (block 7): the
    # next prompt branching there resumes at it
    assert set(range(7 - layout.window_blocks, 7)) <= set(window_positions(svc))
    check(system[:30] + make_tokens(11, seed=18), 28)
    short = make_tokens(5, seed=14)
    check(short, 0)  # stores block 0
    check(short[:4] + make_tokens(6, seed=15), 4)  # p < W: the window reaches position 0
    other = make_tokens(24, seed=16)  # the KV of a no-cache run stores too (every position)
    assert engine.store(other, engine.prefill_no_cache(other).cache) == 6
    check(other + make_tokens(3, seed=17), 24)


@pytest.mark.parametrize("shape", ["mistral", "gemma2"])
def test_greedy_turns_on_a_windowed_pool_are_token_for_token_identical(
        tiny_models: dict[str, Any], shape: str) -> None:
    model = tiny_models[shape]
    with served(model) as svc:
        engine = Engine(model, svc, "ns")
        prompt = make_tokens(33, seed=21)
        want = engine.generate(prompt, 8, use_radixkv=False)  # decoding crosses the window
        assert engine.generate(prompt, 8) == want  # stores prompt + answer
        turn2 = prompt + want + make_tokens(7, seed=22)
        result = engine.prefill(turn2)
        assert result.cached_tokens == (len(prompt) + 7) // BLOCK_SIZE * BLOCK_SIZE  # 40
        assert engine.decode(turn2, result, 6) == engine.generate(turn2, 6, use_radixkv=False)
        assert svc.stats(check_integrity=True)["integrity"] == "ok"


@pytest.mark.parametrize("model_name, flags, message", [
    ("mistral", ("--sliding-window", "8"), "holds KV for a sliding window of 8 tokens on layers "
     "'all' (2 of 2) but this model has a sliding window of 9 tokens on layers 'all' (2 of 2)"),
    ("gemma2", ("--window-layers", "all"), "holds KV for a sliding window of 10 tokens on "
     "layers 'all' (4 of 4) but this model has a sliding window of 10 tokens on layers "
     "'alternate' (2 of 4)"),
    ("gemma2", (), "holds KV for full attention on every layer but this model has a "
     "sliding window of 10 tokens on layers 'alternate' (2 of 4)"),
    ("llama", ("--sliding-window", "10"), "holds KV for a sliding window of 10 tokens on "
     "layers 'all' (2 of 2) but this model has full attention on every layer"),
])
def test_a_pool_whose_window_is_not_the_models_is_refused(
        tiny_models: dict[str, Any], model_name: str, flags: tuple[str, ...],
        message: str) -> None:
    model = tiny_llama.build_model("test") if model_name == "llama" else tiny_models[model_name]
    config: Any = model
    if not flags:  # the same sizes, full attention
        config = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 64,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    extra = ("--num-window-blocks", "8") if flags else ("--num-blocks", "64")
    with served(config, BLOCK_SIZE, *flags, *extra) as svc:
        with pytest.raises(InvalidArgument, match=re.escape(message)):
            Engine(model, svc, "ns")


def test_a_client_without_window_parts_is_refused(tiny_models: dict[str, Any],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_models["gemma2"]
    with served(model) as svc:
        engine = Engine(model, svc, "ns")
        prompt = make_tokens(21, seed=31)
        engine.prefill(prompt)
        lease_of = svc.lease

        def lease_without_window_ids(*args: Any, **kwargs: Any) -> Any:
            lease = lease_of(*args, **kwargs)  # as a lease of a client before window parts
            del lease.window_ids
            return lease

        monkeypatch.setattr(svc, "lease", lease_without_window_ids)
        with pytest.raises(FailedPrecondition, match="sliding-window pool but this client "
                                                     "reads no window parts"):
            engine.prefill(prompt)


# ---- the real model with a window imposed ----------------------------------------------------

SYSTEM = ("You are a helpful assistant for a team that builds a prefix cache for language "
          "model inference. The cache keeps the keys and values of prompts that engines have "
          "already computed, so that a later prompt sharing a prefix skips that work. Answer "
          "briefly and precisely.")
QUESTIONS = ["What does a radix tree index?", "Why keep only the last window of keys?"]


@pytest.mark.parametrize("pattern", ["all", "alternate"])
def test_smollm2_with_a_window_reuses_kv_as_it_recomputes(smollm2: Any, pattern: str) -> None:
    """SmolLM2-135M's weights as a Ministral with W 20 on `pattern` (block 8: 3 window blocks):
    the same model as the Llama while a prompt fits the window; then the engine's reused KV
    gives its no-cache logits and greedy tokens, and out-of-window KV is never read."""
    block = 8
    model = with_window(smollm2.model, 20, pattern)
    tokenize = smollm2.tokenizer
    system = tokenize(SYSTEM)["input_ids"]
    assert len(system) // block * block > 2 * 20  # resumed well past the window
    short = system[:20]  # fits the window: windowed or not, the same logits
    torch.testing.assert_close(no_cache(model, short)[0], no_cache(smollm2.model, short)[0],
                               atol=ATOL, rtol=0)
    with served(model, block) as svc:
        engine = Engine(model, svc, "smollm2")
        engine.prefill(system)
        for question in QUESTIONS:
            prompt = system + tokenize(question)["input_ids"]
            got = engine.prefill(prompt)
            assert got.cached_tokens == len(system) // block * block
            assert_same_as_recompute(engine, prompt, got)
        assert engine.generate(prompt, 5) == engine.generate(prompt, 5, use_radixkv=False)
    matched = len(system) // block
    p, got_logits = resume(model, prompt, matched, block_size=block)
    _, with_garbage = resume(model, prompt, matched, garbage=0, block_size=block)
    assert p == matched * block and torch.equal(with_garbage, got_logits)
