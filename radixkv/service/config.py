"""The service's settings: TTLs, limits, the eviction policy, buffer sizes."""

from __future__ import annotations

from dataclasses import dataclass

from radixkv.index.policies import DEFAULT_POLICY
from radixkv.protocol.errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    lease_ttl_s: float = 30.0
    max_tokens: int = 1 << 20  # per token list
    vocab_size: int | None = None  # when set, token ids must be < vocab_size
    max_namespaces: int = 1024
    # namespaces one client's live leases may span (None: a quarter of max_namespaces)
    max_namespaces_per_client: int | None = None
    max_leases: int = 65536  # live leases in all
    max_leases_per_client: int = 4096  # live leases one client may hold
    max_lease_ttl_s: float = 3600.0  # the longest TTL a call may ask for
    policy: str = DEFAULT_POLICY
    event_buffer: int = 65536
    recent_window: int = 1000  # requests in the "recent" hit rate

    def __post_init__(self) -> None:
        for name in ("lease_ttl_s", "max_lease_ttl_s", "max_tokens", "max_namespaces",
                     "max_leases", "max_leases_per_client", "recent_window",
                     "namespaces_per_client"):
            value = getattr(self, name)
            if not 0 < value < float("inf"):
                raise InvalidArgument(f"ServiceConfig.{name} must be positive, got {value!r}")
        if self.namespaces_per_client > self.max_namespaces:
            raise InvalidArgument(
                f"namespaces per client ({self.namespaces_per_client}, "
                f"--max-namespaces-per-client) exceed the namespaces in all "
                f"({self.max_namespaces}, --max-namespaces)")
        if self.lease_ttl_s > self.max_lease_ttl_s:
            raise InvalidArgument(f"lease ttl {self.lease_ttl_s:g} s exceeds the cap "
                                  f"{self.max_lease_ttl_s:g} s")

    @property
    def namespaces_per_client(self) -> int:
        """The namespaces one client's live leases may span."""
        if self.max_namespaces_per_client is not None:
            return self.max_namespaces_per_client
        return max(1, self.max_namespaces // 4)
