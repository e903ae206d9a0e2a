"""The Hugging Face engine adapter against a real `radixkv serve` subprocess: a random-weight
Llama (GQA, RoPE; fp32, attn_implementation "radixkv") reuses prompt KV and its outputs stay those
of a full recompute, and those of the same weights under transformers' own sdpa attention.

Tolerance: logits within atol 1e-4 (rtol 0) of the no-cache run; measured differences are 0 to
2e-7 on CPU. Greedy tokens must be identical.
"""

from __future__ import annotations

import contextlib
import logging
import random
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

import torch  # noqa: E402
from _server import RunningServer, running_server  # noqa: E402

from radixkv.client.client import Client  # noqa: E402
from radixkv.engines import tiny_llama  # noqa: E402
from radixkv.engines.demo import demo_serve_flags, run_engine_demo  # noqa: E402
from radixkv.engines.hf import Engine, PrefillResult, cache_layers  # noqa: E402
from radixkv.protocol.errors import InvalidArgument  # noqa: E402

ATOL = 1e-4
BLOCK_SIZE = 4
VOCAB = tiny_llama.config_dict("test")["vocab_size"]


def make_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


@contextlib.contextmanager
def serve_test_model(num_blocks: int) -> Iterator[Any]:
    """`running_server` with the test model's layout (its --model-config overrides the tiny one
    that running_server passes first: argparse keeps the last)."""
    with tempfile.TemporaryDirectory(prefix="rkv-hf-") as directory, running_server(
            "--model-config", tiny_llama.write_config(directory, "test"),
            num_blocks=num_blocks, block_size=BLOCK_SIZE) as srv:
        yield srv


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_llama.build_model("test", seed=0)


@pytest.fixture(scope="module")
def reference_model() -> Any:
    """The same weights under transformers' sdpa: the reference for our attention."""
    return tiny_llama.build_model("test", seed=0, attn_implementation="sdpa")


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with serve_test_model(num_blocks=256) as srv:
        yield srv


@pytest.fixture
def engine(model: Any, server: RunningServer, request: pytest.FixtureRequest) -> Iterator[Engine]:
    namespace = f"{tiny_llama.namespace_for('test', 0)}/{request.node.name}"  # tests apart
    eng = Engine(model, server.socket, namespace)
    yield eng
    assert eng.kv is not None
    assert eng.kv.stats(check_integrity=True)["integrity"] == "ok"
    eng.close()


def assert_same_as_recompute(engine: Engine, tokens: list[int], got: PrefillResult) -> None:
    base = engine.prefill_no_cache(tokens)
    torch.testing.assert_close(got.logits_last, base.logits_last, atol=ATOL, rtol=0)
    # the cache built from pool blocks + suffix holds the KV a full recompute holds
    for (k, v), (bk, bv) in zip(cache_layers(got.cache),
                                cache_layers(base.cache), strict=True):
        torch.testing.assert_close(k, bk, atol=ATOL, rtol=0)
        torch.testing.assert_close(v, bv, atol=ATOL, rtol=0)


@pytest.mark.parametrize("shared, expected_cached", [
    (0, 0), (3, 0), (16, 16), (33, 32), (60, 60),
])
def test_reused_kv_gives_the_logits_of_a_full_recompute(engine: Engine, reference_model: Any,
                                                        shared: int,
                                                        expected_cached: int) -> None:
    prefix = make_tokens(shared, seed=1)
    engine.prefill(prefix + make_tokens(61 - shared, seed=2))  # puts the prefix in the cache
    prompt = prefix + make_tokens(61 - shared, seed=3)
    got = engine.prefill(prompt)
    assert got.cached_tokens == expected_cached
    assert_same_as_recompute(engine, prompt, got)
    with torch.inference_mode():
        reference = reference_model(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(got.logits_last, reference, atol=ATOL, rtol=0)


def test_the_baseline_runs_without_autograd_like_the_cached_path(engine: Engine) -> None:
    """Both prefills run under inference mode: a baseline that built an autograd graph would
    time differently from the cached path (and hand out tensors that require grad)."""
    tokens = make_tokens(40, seed=5)
    for result in (engine.prefill_no_cache(tokens), engine.prefill(tokens)):
        assert not result.logits_last.requires_grad
        assert result.logits_last.is_inference()


@pytest.mark.parametrize("length, expected_cached", [(48, 47), (50, 48)])
def test_a_fully_cached_prompt_still_computes_its_last_token(engine: Engine, length: int,
                                                            expected_cached: int) -> None:
    prompt = make_tokens(length, seed=4)
    first = engine.prefill(prompt)
    again = engine.prefill(prompt)
    assert (first.cached_tokens, again.cached_tokens) == (0, expected_cached)
    assert_same_as_recompute(engine, prompt, again)


def test_greedy_generation_is_token_for_token_identical(engine: Engine,
                                                       reference_model: Any) -> None:
    prompt = make_tokens(41, seed=5)
    reference = reference_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert engine.generate(prompt, 12, use_radixkv=False) == reference  # our decode loop = HF's
    assert engine.generate(prompt, 12) == reference  # cold: fills the cache
    assert engine.generate(prompt, 12) == reference  # warm: reuses 40 tokens
    # turn 2 extends turn 1 and its answer; their KV (cached after decoding) is reused
    turn2 = prompt + reference + make_tokens(9, seed=6)
    result = engine.prefill(turn2)
    assert result.cached_tokens == (len(prompt) + 11) // BLOCK_SIZE * BLOCK_SIZE  # 52
    assert engine.decode(turn2, result, 8) == engine.generate(turn2, 8, use_radixkv=False)


def test_an_evicted_prefix_falls_back_to_recompute(model: Any,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    prompts = [make_tokens(40, seed=10 + i) for i in range(3)]  # 10 blocks each
    caplog.set_level(logging.WARNING, logger="radixkv.engines.hf")
    with serve_test_model(num_blocks=24) as srv:
        engine = Engine(model, srv.socket, "evict")
        for p in prompts:  # the third evicts the 6 tail blocks of the first (LRU, tail first)
            engine.prefill(p)
        got = engine.prefill(prompts[0])
        assert got.cached_tokens == 16
        assert_same_as_recompute(engine, prompts[0], got)
        assert engine.prefill(prompts[0]).cached_tokens == 39  # stored again
        long_prompt = make_tokens(120, seed=20)  # 30 blocks > 24: its first 24 are cached
        assert engine.prefill(long_prompt).cached_tokens == 0
        with Client(srv.socket) as other, other.lease("evict", long_prompt) as pin:
            assert pin.num_tokens == 96
            got = engine.prefill(prompts[1])  # every block pinned: not cached, still served
            assert got.cached_tokens == 0
            assert "not caching 10 blocks" in caplog.text
            assert_same_as_recompute(engine, prompts[1], got)
        assert engine.prefill(prompts[1]).cached_tokens == 0  # the pin is gone: cached now
        assert engine.prefill(prompts[1]).cached_tokens == 39
        assert engine.kv is not None
        stats = engine.kv.stats(check_integrity=True)
        assert stats["integrity"] == "ok"
        engine.close()


def test_a_service_with_another_layout_is_refused(server: RunningServer) -> None:
    other = tiny_llama.build_model("demo", seed=0)  # 4 layers, head_dim 32
    with pytest.raises(InvalidArgument, match="holds KV layout .* but this model needs"):
        Engine(other, server.socket, "other")


def test_two_engine_processes_share_kv() -> None:
    """run_engine_demo: engine 0 fills the cache, engine 1 (another process) reuses it."""
    with tempfile.TemporaryDirectory(prefix="rkv-demo-") as directory:
        with running_server(*demo_serve_flags(directory), num_blocks=256) as srv:
            report = run_engine_demo(srv.socket, max_new_tokens=6)
    requests = report["requests"]
    assert [(r["engine"], r["cached_tokens"]) for r in requests] == [
        (0, 0), (1, 400), (1, 464), (0, 464)]  # 400 = system prompt; 464: 400 + 60 + 5 tokens
    assert report["all_match"], requests


def test_a_restarted_service_is_reattached(model: Any) -> None:
    prompt = make_tokens(40, seed=30)
    with tempfile.TemporaryDirectory(prefix="rkv-hf-") as directory:
        config = tiny_llama.write_config(directory, "test")
        sock = f"{directory}/s.sock"
        with running_server("--model-config", config, socket_path=sock) as first:
            engine = Engine(model, first.socket, "restart")
            engine.prefill(prompt)
            assert engine.prefill(prompt).cached_tokens == 39
        with running_server("--model-config", config, socket_path=sock):
            assert engine.kv is not None
            engine.kv.wait_ready()
            got = engine.prefill(prompt)  # new epoch: re-attached, nothing cached yet
            assert got.cached_tokens == 0
            assert_same_as_recompute(engine, prompt, got)
            fresh = Engine(model, sock, "restart")  # sees what went through the new mapping
            again = fresh.prefill(prompt)
            assert again.cached_tokens == 39
            assert_same_as_recompute(fresh, prompt, again)
            fresh.close()
        engine.close()


def test_a_forward_longer_than_the_lease_ttl_still_caches(model: Any,
                                                          caplog: pytest.LogCaptureFixture,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    prompt = make_tokens(40, seed=40)
    caplog.set_level(logging.WARNING, logger="radixkv.engines.hf")
    with tempfile.TemporaryDirectory(prefix="rkv-hf-") as directory, running_server(
            "--model-config", tiny_llama.write_config(directory, "test"), lease_ttl=0.3) as srv:
        engine = Engine(model, srv.socket, "slow")
        engine.prefill(prompt)  # cached while the forward is fast
        forward = engine._forward_hidden

        def slow_forward(*args: Any) -> Any:
            time.sleep(0.8)  # the lease taken at Match expires meanwhile
            return forward(*args)

        monkeypatch.setattr(engine, "_forward_hidden", slow_forward)
        longer = prompt + make_tokens(20, seed=41)
        got = engine.prefill(longer)
        assert got.cached_tokens == 40
        assert "lease expired during a" in caplog.text
        assert_same_as_recompute(engine, longer, got)
        read = engine.prefill(longer, store=False)  # released before the forward: no error
        assert read.cached_tokens == 59
        monkeypatch.undo()
        assert engine.kv is not None
        assert engine.kv.stats(check_integrity=True)["integrity"] == "ok"
        engine.close()


@pytest.mark.parametrize("kv_dtype, min_snr_db", [("int8", 35.0), ("int4", 15.0)])
def test_a_quantized_pool_serves_close_kv_and_exact_sinks(model: Any, kv_dtype: str,
                                                          min_snr_db: float) -> None:
    """The engine writes and reads int8/int4 blocks: the reused K/V are the recompute's within
    the format's error, the sink tokens (position 0 on) bit-exact, and the first layer's
    suffix K/V (which see no cached KV) exact."""
    with tempfile.TemporaryDirectory(prefix="rkv-hf-") as directory, running_server(
            "--model-config", tiny_llama.write_config(directory, "test"),
            "--kv-dtype", kv_dtype, "--kv-sink-tokens", "2", "--kv-sink-fraction", "0.25",
            num_blocks=64, block_size=BLOCK_SIZE) as srv:
        engine = Engine(model, srv.socket, f"{tiny_llama.namespace_for('test', 0)}/q")
        try:
            assert engine.layout is not None and engine.layout.dtype == kv_dtype
            prompt = make_tokens(41, seed=9)
            engine.prefill(prompt)
            got = engine.prefill(prompt)
            assert got.cached_tokens == 40
            base = engine.prefill_no_cache(prompt)
            for layer, ((k, v), (bk, bv)) in enumerate(zip(
                    cache_layers(got.cache), cache_layers(base.cache), strict=True)):
                for mine, ref in ((k, bk), (v, bv)):
                    torch.testing.assert_close(mine[:, :, :2], ref[:, :, :2], atol=0, rtol=0)
                    if layer == 0:
                        torch.testing.assert_close(mine[:, :, 40:], ref[:, :, 40:], atol=1e-5,
                                                   rtol=0)
                    err = (mine[:, :, :40] - ref[:, :, :40]).pow(2).sum()
                    snr = 10 * torch.log10(ref[:, :, :40].pow(2).sum() / err)
                    assert float(snr.detach()) > min_snr_db
            assert engine.kv is not None
            assert engine.kv.stats(check_integrity=True)["integrity"] == "ok"
        finally:
            engine.close()


def test_store_after_first_token_writes_back_behind_the_answer(model: Any,
                                                                server: RunningServer) -> None:
    """The deferred write-back: prefill returns with its logits, the blocks land on a helper
    thread; the engine's next call waits for them, so it hits its own prompt, and another
    engine sees them once `wait_stored` returns. Outputs stay those of a recompute."""
    namespace = f"{tiny_llama.namespace_for('test', 0)}/deferred"
    engine = Engine(model, server.socket, namespace, store_after_first_token=True)
    other = Engine(model, server.socket, namespace)
    try:
        prompt = make_tokens(41, seed=21)
        first = engine.prefill(prompt)
        assert first.cached_tokens == 0
        again = engine.prefill(prompt)  # waited for the first write-back
        assert again.cached_tokens == 40
        assert_same_as_recompute(engine, prompt, again)
        longer = prompt + make_tokens(20, seed=22)
        engine.prefill(longer)
        engine.wait_stored()
        assert other.prefill(longer).cached_tokens == 60
        assert engine.kv is not None
        assert engine.kv.stats(check_integrity=True)["integrity"] == "ok"
    finally:
        engine.close()
        other.close()


def test_engine_syncs_before_every_release(monkeypatch):
    pytest.importorskip("transformers")
    from radixkv.engines import tiny_llama
    from radixkv.engines.hf import Engine

    order: list[str] = []
    monkeypatch.setattr(Engine, "_sync", staticmethod(lambda view: order.append("sync")))
    real_release = Client.release
    monkeypatch.setattr(Client, "release",
                        lambda self, *ids: order.append("release") or real_release(self, *ids))
    with tempfile.TemporaryDirectory(prefix="rkv-hf-") as d, running_server(
            "--model-config", tiny_llama.write_config(d, "test"), num_blocks=64) as s:
        engine = Engine(tiny_llama.build_model("test", seed=0), s.socket, namespace="tiny")
        prompt = list(range(1, 14))
        engine.prefill(prompt)  # stores 3 blocks
        order.clear()
        engine.prefill(prompt)  # all cached: reads only, stores nothing
        assert order == ["sync", "release"]
        engine.close()
