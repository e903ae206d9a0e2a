"""What the service asks of a tier below its pool, and the tier it has without one.

The service calls these, under its lock except `read`, `settle` and `sync_drops`, and never
asks which tier it has:

    plan       before a Match (under the lock): which blocks below continue the prompt's cached
    reserve    prefix; the service makes room, then `reserve` takes pool blocks for them; then
    read       (off the lock) read them into those blocks; then (under the lock again, before
    apply      the Match reads the tree) insert them in the tree; `abandon` undoes a plan that
               is not applied (no room, or its Match failed)
    demote     pool blocks the policy evicted, before they go back to the free list (their
    settle     bytes are copied out by `settle`, off the lock, on the same thread, before the
    claimed    call answers or reads into pool blocks); `claimed`: blocks taken from the free
               list, to be handed out, once no other call still copies out of them
    take_dropped  blocks it dropped that the events had marked as below the pool (published)
    promoting  whether a promotion into a namespace is in flight (Clear waits for it)
    inserted   blocks an Insert adopted (the tier learns their keys; a copy below is dropped)
    cleared    a namespace's blocks dropped by Clear; then `sync_drops` (off the lock) waits
               until they cannot come back after a crash
    stats      its figures; check_integrity its invariants

`NoTier` is the pool alone: every hook does nothing. The disk tier is radixkv/disk/tier.py.
`SettlingLock` is the service's lock: leaving its outermost hold settles, so no locked section
that demoted can answer (or leave a copy owed that another call's `claimed` would wait on).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from radixkv.protocol.values import DiskStats

if TYPE_CHECKING:
    from radixkv.index.results import InsertResult
    from radixkv.service.kinds import Namespace


class NoTier:
    present = False  # False: no tier, so a Match plans nothing (and takes no extra lock round)

    def plan(self, name: str, ns: Namespace | None, tokens: bytes) -> Any:
        """What a Match of `tokens` in namespace `name` (`ns`: its tree, None if it has none
        now) would bring up (None: nothing); it needs `plan.regular` regular and `plan.sinks`
        sink pool blocks, which the service makes room for before `reserve`."""
        return None

    def reserve(self, plan: Any) -> None:
        """Pool blocks for a plan (OutOfBlocks: none; the service abandons the plan)."""

    def read(self, plans: Sequence[Any]) -> None:
        """Read the plans' blocks into their reserved pool blocks (off the service lock)."""

    def apply(self, ns: Namespace, plan: Any) -> int:
        """A read plan's blocks into `ns`'s tree, the rest of its reserved blocks freed;
        returns how many."""
        return 0

    def abandon(self, plan: Any) -> None:
        """Undo a plan that will not be applied (its reserved blocks freed)."""

    @property
    def reserved_blocks(self) -> int:
        """Pool blocks reserved by plans not yet applied or abandoned: neither free, leased
        nor cached, and no tree points at them."""
        return 0

    def demote(self, namespace: str, block_ids: Sequence[int],
               hashes: Sequence[int | None] = ()) -> None:
        """`block_ids` (still holding their KV; `hashes`: their event hashes) leave the pool."""

    def settle(self) -> None:
        """Off the service lock, after a locked section that may have demoted: copy the bytes
        of the blocks this thread demoted out of the pool (before the call answers, and before
        it reads a promotion into pool blocks)."""

    def claimed(self, block_ids: Sequence[int]) -> None:
        """Under the service lock: `block_ids` were just taken from the free list, to be
        handed out (to a lease, or read into); returns once no other call's `settle` is still
        to copy out of one of them."""

    def take_dropped(self) -> list[tuple[str, int]]:
        """(namespace, event hash) of each block demoted here since dropped, since the last
        call: the service publishes a BlockRemoved for them."""
        return []

    def promoting(self, namespace: str) -> bool:
        """A Match is bringing blocks of `namespace` up from this tier now."""
        return False

    def inserted(self, namespace: str, tokens: bytes, block_ids: Sequence[int],
                 result: InsertResult) -> None:
        """An Insert of `block_ids` for `tokens` adopted result.adopted."""

    def cleared(self, namespace: str, block_ids: Sequence[int]) -> int:
        """Clear dropped `block_ids` and the namespace: drop its blocks here too. Returns
        how many the tier held."""
        return 0

    def sync_drops(self) -> None:
        """Off the service lock: return once the blocks dropped so far stay dropped across a
        crash (Unavailable if the tier cannot make it so)."""

    def stats(self) -> DiskStats:
        return DiskStats()

    def check_integrity(self, cached: int) -> None:
        """IntegrityError unless the tier agrees with the `cached` pool block count."""

    def close(self, write_down: bool) -> None:
        """Stop; with `write_down`, first write the pool's cached blocks to the tier."""


class SettlingLock:
    """The service's lock (reentrant): when a thread leaves its outermost hold, the tier
    settles that thread's demotions (`settle`, off the lock), whatever the locked section was
    and however it ended."""

    def __init__(self, tier: NoTier) -> None:
        self._lock = threading.RLock()
        self._tier = tier
        self._depth = 0  # the holder's nesting (only the holder changes it)

    def __enter__(self) -> None:
        self._lock.acquire()
        self._depth += 1

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        outermost = self._depth == 0
        self._lock.release()
        if outermost:
            self._tier.settle()
