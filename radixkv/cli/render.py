"""What the read-only views (`inspect`, `stats`, `events`, the demo) share to print: server text
made terminal-safe, short human figures (ages, token-id previews), and `show`, which prints a
view as JSON or renders it with rich."""

from __future__ import annotations

import json
from typing import Any

from radixkv.protocol.tokens import from_token_bytes, num_tokens

PREVIEW = 8  # token ids shown per edge / prefix


def token_ids(data: bytes, limit: int | None = None) -> list[int]:
    """The token ids packed in `data`, the first `limit` of them (None: all)."""
    end = num_tokens(data) if limit is None else min(num_tokens(data), limit)
    return [int(t) for t in from_token_bytes(data)[:end]]


def ids(values: list[int], total: int) -> str:
    """Ids joined by spaces, with " ..." when they are the first of `total`."""
    return " ".join(map(str, values)) + (" ..." if total > len(values) else "")


def age(seconds: float) -> str:
    """A duration as 12s, 5m or 1.5h."""
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def plain(text: str) -> str:
    """Server-supplied text made safe for a terminal: control and other unprintable characters
    shown as escapes (a name can never move the cursor or recolour the screen)."""
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def markup_safe(text: str) -> str:
    """`plain`, with rich markup escaped too (for text rich renders: tables, trees)."""
    from rich.markup import escape

    return escape(plain(text))


def show(view: Any, as_json: bool, render: Any) -> None:
    """Print `view` as indented JSON, or `render(view)` through a rich console."""
    if as_json:
        print(json.dumps(view, indent=2))
    else:
        from rich.console import Console

        Console().print(render(view))
