"""The real model in two engine processes: two multi-turn chats that share a system prompt, each
turn served by the other process than the one before, so every reuse crosses processes through
the pool.

    prepare()                                  # convert the weights once, before the engines
    flags = serve_flags()                      # start `radixkv serve --socket S *flags`
    report = run_chat_demo(S)                  # -> {"requests": [...], "all_match": ..., ...}

    turn      chat A          chat B
    1         engine 0 cold   engine 1: reuses the system prompt engine 0 wrote
    2         engine 1        engine 0      each reuses its chat's turn 1 (prompt + answer)
    3         engine 0        engine 1      ... and turn 2

Every turn also runs without radixkv in its process (greedy, same prompt): the report has both
TTFTs and whether the answers are token-for-token identical.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from typing import Any

from radixkv.engines import models
from radixkv.engines.chat import Conversation, Message, TurnResult, reusable_tokens

MODEL = models.REAL_MODEL
BLOCK_SIZE = 16
NUM_BLOCKS = 256  # 4,096 tokens, 180 MiB of fp32 KV: both chats fit, nothing is evicted
QUESTIONS = {
    "A": ["What does the with statement do?", "Show a short example.",
          "What happens if the block raises an exception?"],
    "B": ["What is a context manager?", "Which method runs when the block ends?",
          "Can one with statement use two context managers?"],
}

_worker: tuple[Any, Any] | None = None  # (Engine, tokenizer) of this engine process


def system_prompt() -> str:
    """A tutor persona plus two topics of the Python docs (~1,200 tokens), shared by both
    chats."""
    from radixkv.engines import corpus

    topics = corpus.topics()
    return ("You are a friendly Python tutor. Answer in one or two sentences. Use this "
            "reference from the Python documentation:\n\n"
            f"{topics['with']}\n\n{topics['context-managers']}")


def prepare(notify: Callable[[str], None] | None = None) -> None:
    """Convert the model's weights now if needed (ModelNotAvailable when not installed)."""
    models.prepare(MODEL, notify=notify)


def serve_flags() -> list[str]:
    """`radixkv serve` flags for the demo's pool."""
    return [*models.serve_flags(MODEL, ""), "--block-size", str(BLOCK_SIZE),
            "--num-blocks", str(NUM_BLOCKS)]


def init_worker(socket_path: str, model: str) -> None:
    """ProcessPoolExecutor initializer: load the model and connect, once per process."""
    import torch

    from radixkv.engines.hf import Engine

    global _worker
    # One thread per engine: on 2 cores that other work also uses, a 2-thread forward waits
    # at every kernel for the thread the scheduler left out (3-4x slower, TTFTs erratic).
    torch.set_num_threads(1)
    loaded = models.load(model)
    engine = Engine(loaded.model, socket_path, loaded.namespace)
    # warm-up, so that first-call costs stay out of the TTFTs: the first long forward of a
    # process is ~30 % slower (its buffers are new), hence a prompt-sized one
    engine.prefill_no_cache(list(range(1024)))
    engine.prefill(list(range(32)), store=False)
    _worker = (engine, loaded.tokenizer)


def serve_turn(messages: list[Message], max_new_tokens: int) -> dict[str, Any]:
    """In a worker: answer through radixkv, then verify against a no-cache run."""
    from radixkv.engines.chat import answer_turn

    assert _worker is not None, "init_worker was not run"
    engine, tokenizer = _worker
    return answer_turn(engine, tokenizer, messages, max_new_tokens, verify=True).to_dict()


def _ready() -> bool:
    return _worker is not None


def _remote_turn(executor: ProcessPoolExecutor, max_new_tokens: int,
                 messages: list[Message]) -> TurnResult:
    return TurnResult.from_dict(executor.submit(serve_turn, messages, max_new_tokens).result())


def run_chat_demo(socket_path: str, *, turns: int = 3,
                  max_new_tokens: int = 40,
                  on_turn: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run both chats against the service at `socket_path` (started with `serve_flags`).
    Returns {"model", "requests": [{"name", "chat", "turn", "engine", "user", "answer",
    "prompt_tokens", "cached_tokens", "reusable_tokens", "ttft_s", "ttft_no_cache_s",
    "ttft_saved_s", "max_abs_logit_diff", "match", ...}], "all_match", "ttft_saved_s"};
    `reusable_tokens`: the full blocks of the chat's previous turn (prompt and answer).
    `on_turn` sees each request as it completes."""
    if not 1 <= turns <= len(QUESTIONS["A"]):
        raise ValueError(f"turns must be 1..{len(QUESTIONS['A'])}, got {turns}")
    ctx = multiprocessing.get_context("spawn")  # torch and gRPC are not fork-safe
    engines = [ProcessPoolExecutor(1, mp_context=ctx, initializer=init_worker,
                                   initargs=(socket_path, MODEL)) for _ in range(2)]
    system = system_prompt()
    chats = {name: Conversation(system) for name in QUESTIONS}
    previous: dict[str, TurnResult] = {}
    requests: list[dict[str, Any]] = []
    try:
        ready = [ex.submit(_ready) for ex in engines]  # both load at once, before any request
        assert all(future.result() for future in ready)
        for turn in range(turns):
            for index, (name, chat) in enumerate(chats.items()):
                engine = (turn + index) % 2  # never the engine of this chat's previous turn
                user = QUESTIONS[name][turn]
                result = chat.ask(user, partial(_remote_turn, engines[engine], max_new_tokens))
                before = previous.get(name)
                reusable = reusable_tokens(before.prompt_tokens, len(before.tokens),
                                           BLOCK_SIZE) if before else 0
                previous[name] = result
                record = {"name": f"chat {name} turn {turn + 1}", "chat": name,
                          "turn": turn + 1, "engine": engine, "user": user,
                          **result.to_dict(), "reusable_tokens": reusable,
                          "ttft_saved_s": (result.ttft_no_cache_s or 0.0) - result.ttft_s,
                          "match": bool(result.identical)}
                requests.append(record)
                if on_turn:
                    on_turn(record)
    finally:
        for ex in engines:
            ex.shutdown()
    return {"model": MODEL, "requests": requests,
            "all_match": all(r["match"] for r in requests),
            "ttft_saved_s": sum(r["ttft_saved_s"] for r in requests)}
