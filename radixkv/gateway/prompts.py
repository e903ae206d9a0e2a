"""The prompt as the engine will see it: the token ids of an OpenAI completions or chat body,
made with the model's own tokenizer and chat template (transformers), as vLLM makes them.

Only routing uses these ids (the engine tokenizes again for itself), so a template the gateway
renders differently from the engine costs a cache miss, never a wrong answer."""

from __future__ import annotations

from typing import Any


class BadRequest(ValueError):
    """A body the engines would refuse too: OpenAI's 400, with the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class Prompts:
    """Token ids from request bodies, with the tokenizer at `path` (a model directory or hub
    name). Thread-safe for reading (the gateway tokenizes on worker threads)."""

    def __init__(self, path: str) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as e:
            raise RuntimeError("the gateway tokenizes prompts with transformers: install "
                               "radixkv's hf extra (pip install 'radixkv[hf]')") from e
        self.tokenizer = AutoTokenizer.from_pretrained(path)

    def completion(self, body: dict[str, Any]) -> list[int]:
        """The ids of a completions body's prompt (its first one, for a batch of prompts)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch: the first prompt routes it
        if isinstance(prompt, str) and prompt:
            return list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            return prompt
        raise BadRequest("'prompt' must be a non-empty string, a list of token ids, or a list "
                         "of those", "prompt")

    def chat(self, body: dict[str, Any]) -> list[int]:
        """The ids of a chat body's messages under the model's chat template, with the
        generation prompt unless the body says otherwise."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise BadRequest("'messages' must be a non-empty list of {role, content} objects",
                             "messages")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise BadRequest("'chat_template_kwargs' must be an object", "chat_template_kwargs")
        try:  # rendered as text, then tokenized without special tokens: as vLLM does
            text: Any = self.tokenizer.apply_chat_template(
                [{**m, "content": text_of(m.get("content"))} for m in messages],
                add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                tokenize=False, **kwargs)
        except (TypeError, ValueError, KeyError) as e:
            raise BadRequest(f"the chat template cannot render these messages: {e}",
                             "messages") from None
        return list(self.tokenizer(str(text), add_special_tokens=False)["input_ids"])


def text_of(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list joined by newlines
    (as vLLM renders parts for a text-only template)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content
                 if isinstance(p, dict) and p.get("type") == "text"]
        return "\n".join(str(p) for p in parts)
    raise BadRequest("a message's 'content' must be a string or a list of parts", "messages")
