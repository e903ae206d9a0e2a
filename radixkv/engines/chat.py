"""Multi-turn chat through an engine that reuses KV: the front end re-sends the whole
conversation every turn (as an OpenAI-style server receives it), the engine renders it with the
model's chat template, and radixkv hands back the KV of everything an earlier turn computed.

    turn 1   [system][user 1]<assistant>                 prefill all; decode answer 1
    turn 2   [system][user 1]<assistant>[answer 1][user 2]<assistant>
             |<------- cached by turn 1 (prompt + answer) ------>|  prefill only the rest

An answer's KV is cached after decoding (`Engine.store`), so the next turn reuses it too. That
needs the template to render an earlier answer as the tokens the model generated: the answer
text goes back verbatim (never stripped), and SmolLM2's template re-tokenizes it to the same
ids. A turn whose re-tokenized history diverges still works; it reuses less.

    conversation = Conversation(system="You are ...")
    result = conversation.ask("What does `with` do?", lambda messages: answer_turn(
        engine, tokenizer, messages, max_new_tokens=64))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from radixkv.engines.hf import Engine

Message = dict[str, str]


@dataclass(frozen=True, slots=True)
class TurnResult:
    """One answered turn. TTFTs in seconds (prefill up to the first token's logits);
    `ttft_no_cache_s` and `max_abs_logit_diff` (first-token logits against that no-cache
    prefill) are None when no baseline ran, `identical` (greedy answer equal to a no-cache
    generation) when not verified."""

    answer: str
    tokens: tuple[int, ...]  # generated ids, the end-of-turn token included when reached
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    ttft_no_cache_s: float | None = None
    max_abs_logit_diff: float | None = None
    identical: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["tokens"] = list(self.tokens)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TurnResult:
        return cls(**{**d, "tokens": tuple(d["tokens"])})

    def summary(self) -> str:
        """'reused N of M prompt tokens, TTFT x ms (no cache: y ms)'."""
        line = (f"reused {self.cached_tokens} of {self.prompt_tokens} prompt tokens, "
                f"TTFT {self.ttft_s * 1e3:.0f} ms")
        if self.ttft_no_cache_s is not None:
            line += f" (no cache: {self.ttft_no_cache_s * 1e3:.0f} ms)"
        if self.identical is not None:
            line += f", identical to a no-cache run: {'yes' if self.identical else 'NO'}"
        return line


def prompt_ids(tokenizer: Any, messages: Sequence[Message]) -> list[int]:
    """The conversation rendered by the model's chat template, ready for the assistant's
    answer."""
    rendered = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True,
                                             tokenize=True, return_dict=True)
    return list(rendered["input_ids"])


def answer_turn(engine: Engine, tokenizer: Any, messages: Sequence[Message],
                max_new_tokens: int, *, baseline: bool = True,
                verify: bool = False) -> TurnResult:
    """Answer the last user message of `messages` greedily: prefill through radixkv, decode,
    cache prompt + answer. `baseline` also prefills without radixkv (its TTFT and the
    first-token logits' difference); `verify` also generates without radixkv and compares."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    eos = tokenizer.eos_token_id
    ids = prompt_ids(tokenizer, messages)
    result = engine.prefill(ids)
    out = engine.decode(ids, result, max_new_tokens, eos_token_id=eos)
    engine.store(ids + out[:-1], result.cache)  # the next turn reuses the answer too
    ttft_base = diff = identical = None
    if baseline or verify:
        base = engine.prefill_no_cache(ids)
        ttft_base = base.timings["total"]
        diff = float((result.logits_last - base.logits_last).abs().max())
        if verify:
            identical = engine.decode(ids, base, max_new_tokens, eos_token_id=eos) == out
    text_ids = out[:-1] if out[-1] == eos else out
    answer = tokenizer.decode(text_ids, skip_special_tokens=True)
    return TurnResult(answer, tuple(out), len(ids), result.cached_tokens,
                      result.timings["total"], ttft_base, diff, identical)


class Conversation:
    """The front end's side of a chat: the messages so far, re-sent whole every turn."""

    def __init__(self, system: str | None = None) -> None:
        self.system = system
        self.messages: list[Message] = []
        self.reset()

    def reset(self) -> None:
        """Start over (the system prompt stays)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def ask(self, user: str, serve: Callable[[list[Message]], TurnResult]) -> TurnResult:
        """Send the history plus `user` to `serve` (an engine, here or in another process);
        the answer joins the history."""
        messages = [*self.messages, {"role": "user", "content": user}]
        result = serve(messages)
        self.messages = [*messages, {"role": "assistant", "content": result.answer}]
        return result


def reusable_tokens(prompt_tokens: int, generated: int, block_size: int) -> int:
    """Tokens of a turn that the next turn can reuse: the full blocks of its prompt and answer
    (the answer's last token has no KV: it was never fed back)."""
    return (prompt_tokens + generated - 1) // block_size * block_size

