"""The project's exceptions: the pool's own (`kvpool.errors`, re-exported here) and the
service's. Each names the gRPC status it maps to (by name, so that this module does not import
grpc); the server aborts through one table built from `code`, and the client maps status codes
back to these classes."""

from __future__ import annotations

from kvpool.errors import (
    IntegrityError,
    InvalidArgument,
    OutOfBlocks,
    PermissionDenied,
    PoolError,
    StalePool,
    Unavailable,
)

RadixKVError = PoolError
"""Base class of the project's errors; the pool layer defines it, so its errors share the table."""


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


class Unauthenticated(RadixKVError):
    """A call without the service's auth token."""

    code = "UNAUTHENTICATED"


class AlreadyExists(RadixKVError):
    """Blocks that are already in the tree, or a second server on the same socket."""

    code = "ALREADY_EXISTS"


class LimitExceeded(RadixKVError):
    """A per-service or per-client limit: namespaces, live leases of one client. A limit on a
    rate says when to retry (`retry_after_s`, None otherwise)."""

    code = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


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
    IntegrityError,
    LimitExceeded,
)

__all__ = [
    "ALL_ERRORS",
    "AlreadyExists",
    "FailedPrecondition",
    "IntegrityError",
    "InvalidArgument",
    "LeaseExpired",
    "LimitExceeded",
    "NotFound",
    "OutOfBlocks",
    "PermissionDenied",
    "RadixKVError",
    "StalePool",
    "Unauthenticated",
    "Unavailable",
]
