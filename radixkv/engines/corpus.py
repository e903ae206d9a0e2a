"""English prose that ships with CPython: `pydoc_data.topics.topics` (the text of `help()` on
79 topics about Python, ~465 KB, ~113k SmolLM2 tokens). The perplexity harness, the demo's
system prompt and the TTFT bench's prompts read it, so nothing is downloaded."""

from __future__ import annotations

from typing import Any


def topics() -> dict[str, str]:
    """Topic name -> text, in a fixed (sorted) order."""
    from pydoc_data.topics import topics as table

    return {name: table[name].strip() for name in sorted(table)}


def text() -> str:
    """Every topic's text joined by blank lines, in sorted topic order."""
    return "\n\n".join(topics().values())


def tokens(tokenizer: Any) -> list[int]:
    """`text()` as token ids (no special tokens)."""
    ids: list[int] = tokenizer(text(), add_special_tokens=False)["input_ids"]
    return ids
