"""Per-peer counters of peer fetch (blocks and bytes in and out, fetches, failures), as Stats
reports them in `peers` and `radixkv inspect` shows them. Thread-safe."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

from radixkv.v1 import radixkv_pb2 as pb

RECENT = 256  # fetch times kept per peer


@dataclass
class PeerCount:
    blocks_in: int = 0
    bytes_in: int = 0
    blocks_out: int = 0
    bytes_out: int = 0
    fetches: int = 0
    failures: int = 0
    checksum_failures: int = 0
    fetch_ms: float = 0.0
    recent_fetch_ms: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))


class PeerCounters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._peers: dict[str, PeerCount] = {}

    def _of(self, node: str) -> PeerCount:
        return self._peers.setdefault(node, PeerCount())

    def sent(self, node: str, blocks: int, nbytes: int) -> None:
        with self._lock:
            c = self._of(node)
            c.blocks_out += blocks
            c.bytes_out += nbytes

    def fetched(self, node: str, blocks: int, nbytes: int, ms: float, failed: bool,
                bad_checksums: int) -> None:
        """One fetch from `node`: the verified blocks it brought (inserted here), its time,
        whether it failed before the end, and the blocks dropped for their checksum."""
        with self._lock:
            c = self._of(node)
            c.blocks_in += blocks
            c.bytes_in += nbytes
            c.fetches += blocks > 0
            c.failures += failed
            c.checksum_failures += bad_checksums
            c.fetch_ms += ms
            c.recent_fetch_ms.append(ms)

    def snapshot(self) -> dict[str, PeerCount]:
        with self._lock:
            return {n: PeerCount(**{**vars(c), "recent_fetch_ms": deque(c.recent_fetch_ms)})
                    for n, c in self._peers.items()}

    def stats_pb(self) -> list[pb.PeerStats]:
        return [pb.PeerStats(node_id=n, **vars(c)) for n, c in sorted(self.snapshot().items())]
