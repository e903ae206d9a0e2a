"""Token ids (and block ids) as little-endian uint32 `bytes`, the form the tree and the wire use.

`to_token_bytes` is the one place where other forms (bytearray, memoryview, numpy arrays, lists of
ints) are checked and converted; `bytes` pass through untouched, so hot paths pay nothing.
"""

from __future__ import annotations

import array
import struct
import sys
from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from radixkv.protocol.errors import InvalidArgument

TokensLike: TypeAlias = bytes | bytearray | memoryview | npt.NDArray[Any] | Sequence[int]

TOKEN_DTYPE = np.dtype("<u4")
TOKEN_BYTES = TOKEN_DTYPE.itemsize  # one id in the tree and on the wire
_MAX_TOKEN = 2**32
assert array.array("I").itemsize == 4, "array code 'I' must be 32-bit on supported platforms"


def num_tokens(data: bytes | bytearray | memoryview) -> int:
    """How many ids `data` (token bytes) holds."""
    return len(data) // TOKEN_BYTES


def block_bytes(block_size: int) -> int:
    """Bytes of one block's token ids: the stride of a block in token bytes."""
    return TOKEN_BYTES * block_size


def to_token_bytes(tokens: TokensLike) -> bytes:
    """Little-endian uint32 bytes of `tokens`; `bytes` input is returned as is (no copy).

    Raises InvalidArgument for a byte length that is not a multiple of 4, a non-integer or
    multi-dimensional array, or a token outside [0, 2**32) (naming its index and value)."""
    if type(tokens) is bytes:
        if len(tokens) % TOKEN_BYTES:
            raise InvalidArgument(f"token bytes must be a multiple of 4 long, got {len(tokens)}")
        return tokens
    if isinstance(tokens, bytes | bytearray | memoryview):
        data = bytes(tokens)
        if len(data) % TOKEN_BYTES:
            raise InvalidArgument(f"token bytes must be a multiple of 4 long, got {len(data)}")
        return data
    if isinstance(tokens, np.ndarray):
        return _array_to_bytes(tokens)
    try:
        return ids_to_bytes(tokens)
    except (OverflowError, TypeError):
        for i, t in enumerate(tokens):
            if not isinstance(t, int | np.integer) or not 0 <= t < _MAX_TOKEN:
                raise InvalidArgument(
                    f"token {i} is {t!r}: token ids must be integers in [0, 2**32)"
                ) from None
        raise


def _array_to_bytes(tokens: npt.NDArray[Any]) -> bytes:
    if tokens.ndim != 1:
        raise InvalidArgument(f"token array must be 1-D, got shape {tokens.shape}")
    if tokens.dtype.kind not in "iu":
        raise InvalidArgument(f"token array must have an integer dtype, got {tokens.dtype}")
    if tokens.dtype != TOKEN_DTYPE and tokens.size:
        bad = np.flatnonzero((tokens < 0) | (tokens >= _MAX_TOKEN))
        if bad.size:
            i = int(bad[0])
            raise InvalidArgument(
                f"token {i} is {int(tokens[i])}: token ids must be integers in [0, 2**32)"
            )
    return tokens.astype(TOKEN_DTYPE, copy=False).tobytes()


def from_token_bytes(data: bytes | bytearray | memoryview) -> npt.NDArray[np.uint32]:
    """A zero-copy uint32 view of token bytes (read-only for `bytes`)."""
    nbytes = data.nbytes if isinstance(data, memoryview) else len(data)
    if nbytes % TOKEN_BYTES:
        raise InvalidArgument(f"token bytes must be a multiple of 4 long, got {nbytes}")
    return np.frombuffer(data, dtype=TOKEN_DTYPE)


def ids_from_bytes(data: bytes) -> tuple[int, ...]:
    """Ids (block ids on the wire) from little-endian uint32 bytes, as a tuple of ints."""
    if len(data) % TOKEN_BYTES:
        raise InvalidArgument(f"id bytes must be a multiple of 4 long, got {len(data)}")
    return struct.unpack(f"<{num_tokens(data)}I", data)  # half the time of tuple(array(...))


def ids_to_bytes(ids: Sequence[int]) -> bytes:
    """Ids known to fit uint32 (block ids the service holds) as little-endian uint32 bytes:
    `to_token_bytes` without its checks and messages, for the reply path. OverflowError or
    TypeError for anything else."""
    packed = array.array("I", ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def key_bytes(keys: Sequence[bytes]) -> tuple[bytes, int]:
    """Block keys as the wire carries them: concatenated, and the size of one; InvalidArgument
    for none or keys of different sizes (the service checks the size itself)."""
    if not keys:
        raise InvalidArgument("empty key list")
    size = len(keys[0])
    for i, k in enumerate(keys):
        if len(k) != size:
            raise InvalidArgument(f"key {i} is {len(k)} bytes, key 0 is {size}: one key size "
                                  "per sequence")
    return b"".join(keys), size
