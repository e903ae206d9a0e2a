"""Retention hints a client may attach to a request (Insert / Release): what it knows about the
session's future, for the eviction policy (radixkv.index.adaptive uses them, others ignore them).
"""

from __future__ import annotations

from radixkv.protocol.errors import InvalidArgument

# Retention hints a client may attach to a request (Insert / Release): what it knows about the
# session's future. NO_HINT is the default; a hint stays on its nodes until their next hit.
NO_HINT, SESSION_END, KEEP = 0, 1, 2
HINTS: dict[str, int] = {"": NO_HINT, "none": NO_HINT, "session_end": SESSION_END, "keep": KEEP}


def parse_hint(hint: str | int | None) -> int:
    """A hint's code from its name ("session_end", "keep", "" / "none") or code; InvalidArgument
    for anything else."""
    if hint is None:
        return NO_HINT
    if isinstance(hint, int) and hint in HINTS.values():
        return hint
    if isinstance(hint, str) and hint in HINTS:
        return HINTS[hint]
    raise InvalidArgument(f"unknown retention hint {hint!r}; choose session_end, keep or none")
