"""The pool's exceptions. `code` names the gRPC status a server answers with (by name: this layer
imports no grpc); `radixkv.errors` builds its status table on `PoolError` and adds its own."""

from __future__ import annotations


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
