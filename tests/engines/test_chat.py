"""The real model (SmolLM2-135M, fp32) through a real `radixkv serve`: `radixkv chat` in its own
process writes a 3-turn chat's KV; this process (a second engine) reads it back.

Tolerance: first-token logits within atol 2e-4 (rtol 0) of a no-cache run (measured up to
3e-5: the suffix attention merges two partial softmaxes); greedy tokens must be identical.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

import torch  # noqa: E402
from _server import REPO, RunningServer, running_server  # noqa: E402

from radixkv.engines.chat import Conversation, TurnResult, prompt_ids, reusable_tokens  # noqa: E402
from radixkv.engines.hf import Engine  # noqa: E402

ATOL = 2e-4
BLOCK_SIZE = 16
SYSTEM = "You are a concise assistant who answers questions about Python."
QUESTIONS = ["What is a Python generator?", "Show a short example.", "Why use one?"]


@pytest.fixture(scope="module")
def server(smollm2: Any) -> Iterator[RunningServer]:
    with tempfile.TemporaryDirectory(prefix="rkv-chat-") as directory, running_server(
            *smollm2.serve_flags(directory), num_blocks=64, block_size=BLOCK_SIZE) as srv:
        yield srv


def chat_cli(socket: str, *args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "radixkv", "chat", "--socket", socket, *args],
                         capture_output=True, text=True, cwd=REPO, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def test_a_chat_in_another_process_reuses_every_turn_and_matches(smollm2: Any,
                                                                 server: RunningServer) -> None:
    args = ["--system", SYSTEM, "--max-new-tokens", "12", "--verify", "--threads", "1", "--json"]
    for question in QUESTIONS:
        args += ["--message", question]
    report = chat_cli(server.socket, *args)
    assert report["namespace"] == smollm2.namespace
    turns = [TurnResult.from_dict({k: v for k, v in t.items() if k != "user"})
             for t in report["turns"]]
    assert [t["user"] for t in report["turns"]] == QUESTIONS
    assert all(t.identical for t in turns), turns
    assert all(t.answer.strip() for t in turns)
    assert turns[0].cached_tokens == 0
    for before, turn in zip(turns, turns[1:], strict=False):  # reuses every earlier turn
        assert turn.cached_tokens >= reusable_tokens(before.prompt_tokens, len(before.tokens),
                                                     BLOCK_SIZE)
        assert turn.max_abs_logit_diff is not None and turn.max_abs_logit_diff <= ATOL

    # this process, another engine, continues the chat on the KV the CLI process wrote
    chat = Conversation(SYSTEM)
    for question, turn in zip(QUESTIONS, turns, strict=True):
        chat.messages += [{"role": "user", "content": question},
                          {"role": "assistant", "content": turn.answer}]
    messages = [*chat.messages, {"role": "user", "content": "Thanks!"}]
    ids = prompt_ids(smollm2.tokenizer, messages)
    engine = Engine(smollm2.model, server.socket, smollm2.namespace)
    got = engine.prefill(ids, store=False)
    last = turns[-1]
    assert got.cached_tokens >= reusable_tokens(last.prompt_tokens, len(last.tokens), BLOCK_SIZE)
    base = engine.prefill_no_cache(ids)
    torch.testing.assert_close(got.logits_last, base.logits_last, atol=ATOL, rtol=0)
    eos = smollm2.tokenizer.eos_token_id
    assert engine.decode(ids, got, 12, eos) == engine.decode(ids, base, 12, eos)
    assert engine.kv is not None
    assert engine.kv.stats(check_integrity=True)["integrity"] == "ok"
    engine.close()


def test_chat_refuses_a_service_with_another_layout() -> None:
    with running_server() as srv:  # the tiny test layout
        out = subprocess.run([sys.executable, "-m", "radixkv", "chat", "--socket", srv.socket,
                              "--message", "hi"], capture_output=True, text=True, cwd=REPO,
                             timeout=120)
    if "needs the package" in out.stderr:
        pytest.skip(out.stderr.strip())
    assert out.returncode == 2
    assert "radixkv serve --preset smollm2-135m" in out.stderr
