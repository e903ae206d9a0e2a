"""A replay's figures per tier when its service has a disk tier (`radixkv replay
--disk-capacity-blocks N`): where the hits came from, and the disk tier's traffic."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class DiskFigures:
    """The service's disk tier counters over the replay (deltas of Stats)."""

    capacity_blocks: int
    hit_tokens: int  # of the replay's hit tokens, those promoted from disk
    demoted_blocks: int
    promoted_blocks: int
    evicted_blocks: int
    verify_failures: int  # slots that failed their checksum when read (a miss, never served)
    # pricing the disk hits' reads (the replay's own blocks are tiny): the KV bytes per token
    # of the model priced (--preset, --kv-dtype) and the disk's read bandwidth
    read_bytes_per_token: int = 0
    read_GBps: float = 0.0

    def read_seconds(self) -> float:
        """Seconds the disk hits' reads take at `read_GBps` (0 when not priced)."""
        if not self.read_GBps:
            return 0.0
        return self.hit_tokens * self.read_bytes_per_token / (self.read_GBps * 1e9)

    def by_tier(self, hit_tokens: int, prompt_tokens: int) -> dict[str, float]:
        """Token hit rate of each tier: hits found in memory, and promoted from disk."""
        n = max(1, prompt_tokens)
        return {"memory": (hit_tokens - self.hit_tokens) / n, "disk": self.hit_tokens / n}

    def add_to(self, out: dict[str, Any], hit_tokens: int, prompt_tokens: int,
               saved_s: float) -> None:
        """Into a report's JSON: these figures, the hit rate of each tier, and the prefill
        seconds saved net of the disk hits' reads (priced: they are not free)."""
        out["disk"] = {**asdict(self), "read_seconds": self.read_seconds()}
        out["hit_rate_by_tier"] = self.by_tier(hit_tokens, prompt_tokens)
        out["prefill_saved"]["seconds_net_of_disk_reads"] = saved_s - self.read_seconds()

    def line(self, hit_tokens: int, prompt_tokens: int) -> str:
        rates = self.by_tier(hit_tokens, prompt_tokens)
        return (f"{100 * rates['memory']:.2f}% of prompt tokens hit in memory, "
                f"{100 * rates['disk']:.2f}% on disk ({self.capacity_blocks:,} blocks); "
                f"{self.demoted_blocks:,} demoted, {self.promoted_blocks:,} promoted, "
                f"{self.evicted_blocks:,} dropped, {self.verify_failures} failed their checksum")
