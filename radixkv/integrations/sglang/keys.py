"""What SGLang names, as radixkv names it: a call's page keys (hex chain hashes) as the key path
from the sequence start, and the backend's namespace (model, ranks, dtype, page size)."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from radixkv.protocol.limits import MAX_KEY_SIZE, MIN_KEY_SIZE

log = logging.getLogger("radixkv.integrations.sglang")

_UNSAFE = re.compile(r"[^!-~]")  # namespace names: printable ASCII without spaces


def namespace_name(config: Any, extra: dict[str, Any], dtype: str, page_size: int) -> str:
    """`sglang:MODEL/tpRofN/ppRofN/dpR/DTYPE/pagePAGE` for SGLang's storage `config` (`namespace`
    in the extra config replaces MODEL; MLA models, one writer for every rank, get `mla`)."""
    c = config
    model = extra.get("namespace") or getattr(c, "model_name", None) or "model"
    name = (f"sglang:{model}/tp{c.tp_rank}of{c.tp_size}/pp{c.pp_rank}of{c.pp_size}"
            f"/dp{getattr(c, 'dp_rank', 0)}/{dtype}/page{page_size}")
    if getattr(c, "is_mla_model", False):  # one writer for every rank: one namespace
        name = name.replace(f"tp{c.tp_rank}of{c.tp_size}", "mla")
    return _UNSAFE.sub("_", name)[:256]


class KeyPaths:
    """A call's keys as the key path from the sequence start; warns once when SGLang passes no
    prefix keys (each call's keys then stand alone, a path from the root)."""

    def __init__(self) -> None:
        self.warned_prefix = False

    def path(self, keys: Sequence[str], extra_info: Any) -> tuple[list[bytes] | None, int]:
        """The key path from the sequence start (prefix keys, then `keys`) as bytes, and where
        `keys` start in it; (None, 0), logged, for a key that is not hex of 8..64 bytes."""
        prefix = getattr(extra_info, "prefix_keys", None)
        if prefix is None and not self.warned_prefix and extra_info is not None:
            self.warned_prefix = True
            log.warning("radixkv: SGLang passes no prefix keys; set "
                        "\"hicache_storage_pass_prefix_keys\": true in the extra config so "
                        "that pages stored in separate calls form one path")
        try:
            path = [bytes.fromhex(k) for k in (*(prefix or ()), *keys)]
        except (ValueError, TypeError) as e:
            log.error("radixkv: SGLang gave a page key that is not hex (%s): %s", e,
                      next((k for k in keys if not _is_hex(k)), "?"))
            return None, 0
        bad = next((k for k in path if len(k) != len(path[0]) or len(k) % 4
                    or not MIN_KEY_SIZE <= len(k) <= MAX_KEY_SIZE), None)
        if not path or bad is not None:
            log.error("radixkv: page keys must be hex of %d..%d bytes (a multiple of 4), all of "
                      "one size; got %d bytes", MIN_KEY_SIZE, MAX_KEY_SIZE,
                      len(bad) if bad is not None else 0)
            return None, 0
        return path, len(prefix or ())


def _is_hex(key: Any) -> bool:
    try:
        bytes.fromhex(key)
        return True
    except (ValueError, TypeError):
        return False
