"""The pool's exceptions. `code` names the gRPC status a server answers with (by name: this layer
imports no grpc); `radixkv.protocol.errors` builds its status table on `PoolError` and adds its own.
`as_index` checks the integer arguments every pool module takes (block ids, counts)."""

from __future__ import annotations

import operator


class PoolError(Exception):
    """Base class of every error the pool (and the service above it) raises."""

    code = "INTERNAL"


class InvalidArgument(PoolError, ValueError):
    """Malformed input: a bad layout, block ids out of range, mismatched lengths."""

    code = "INVALID_ARGUMENT"


class OutOfBlocks(PoolError):
    """Not enough free blocks."""

    code = "RESOURCE_EXHAUSTED"


class PermissionDenied(PoolError):
    """A mapping or segment that belongs to another owner."""

    code = "PERMISSION_DENIED"


class StalePool(PoolError):
    """The pool mapping belongs to an earlier service start (its epoch changed)."""

    code = "FAILED_PRECONDITION"


class Unavailable(PoolError):
    """The pool's memory cannot be reached, or a needed device (GPU, CuPy) is missing."""

    code = "UNAVAILABLE"


class IntegrityError(PoolError):
    """A broken invariant: the pool's (or the cache's) accounting is corrupt."""

    code = "DATA_LOSS"


def as_index(value: object, what: str) -> int:
    """An int-like argument (int, numpy integer) that is not a bool, else InvalidArgument
    naming `what`."""
    if isinstance(value, bool):
        raise InvalidArgument(f"{what} must be an integer, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgument(f"{what} must be an integer, got {value!r}") from None
