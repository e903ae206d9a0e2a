"""The project's exceptions. Each names the gRPC status it maps to (by name, so that this module
does not import grpc); the server aborts through one table built from `code`, and the client maps
status codes back to these classes."""

from __future__ import annotations


class RadixKVError(Exception):
    """Base class. `code` is the name of a `grpc.StatusCode` member."""

    code = "INTERNAL"


class InvalidArgument(RadixKVError, ValueError):
    """Malformed input: empty or oversized token lists, ids out of range, mismatched lengths."""

    code = "INVALID_ARGUMENT"


class NotFound(RadixKVError, KeyError):
    """An unknown lease, namespace or block."""

    code = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class LeaseExpired(RadixKVError):
    """The lease existed but ran past its TTL; its pins and blocks were already reclaimed."""

    code = "FAILED_PRECONDITION"


class FailedPrecondition(RadixKVError):
    """The call is well-formed but the state does not allow it (e.g. clearing a namespace
    whose blocks are pinned)."""

    code = "FAILED_PRECONDITION"


class PermissionDenied(RadixKVError):
    """A lease or block that belongs to another owner or namespace."""

    code = "PERMISSION_DENIED"


class Unauthenticated(RadixKVError):
    """A call without the service's auth token."""

    code = "UNAUTHENTICATED"


class AlreadyExists(RadixKVError):
    """Blocks that are already in the tree, or a second server on the same socket."""

    code = "ALREADY_EXISTS"


class OutOfBlocks(RadixKVError):
    """Not enough free blocks even after evicting every unpinned leaf."""

    code = "RESOURCE_EXHAUSTED"


class StalePool(RadixKVError):
    """The pool mapping belongs to an earlier service start (its epoch changed)."""

    code = "FAILED_PRECONDITION"


class Unavailable(RadixKVError):
    """The service cannot be reached, or a needed device (GPU, CuPy) is missing."""

    code = "UNAVAILABLE"


ALL_ERRORS: tuple[type[RadixKVError], ...] = (
    InvalidArgument,
    NotFound,
    LeaseExpired,
    FailedPrecondition,
    PermissionDenied,
    Unauthenticated,
    AlreadyExists,
    OutOfBlocks,
    StalePool,
    Unavailable,
)
