"""Which blocks the disk tier holds, in which slot, and which goes first when it is full.

A block on disk is known by its namespace and chain hash (radixkv/disk/slots.py `chain_hash`:
its parent's hash and its own tokens), so a Match that leaves the pool's tree at block k finds
the blocks k, k+1, ... of its prompt on disk by hashing them, and the entries link to their
parents by hash: the disk tier's tree.

Eviction: least recently demoted first. A block comes to disk when the pool's policy evicts it
(so demotion order is already the pool policy's order, recency and frequency included), and
leaves it when a Match promotes it back; nothing touches a block while it is on disk. The pool
evicts a leaf's tail first, so a block is demoted before its parent and, on disk, goes before
it too: the disk tier drops leaves first without a second policy to keep in step. (A block
whose parent went first stays until its turn; nothing can reach it.)
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from radixkv.disk.slots import SlotMeta

Key = tuple[str, bytes]  # (namespace, chain hash)


@dataclass(slots=True, eq=False)
class Entry:
    meta: SlotMeta
    slot: int
    staging: bytes | memoryview | None = None  # the payload while its write is queued
    event_hash: int | None = None  # what the events named it by, if they marked it on disk
    # the pool block its payload is still to be copied out of (a demotion not yet settled:
    # radixkv/disk/tier.py); None once copied, or once it leaves the index (the copy is then
    # not made, or not written)
    pending: int | None = None


class DiskIndex:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free = list(range(capacity - 1, -1, -1))  # pop() gives slot 0 first
        self._free_set = set(self._free)
        self._lru: OrderedDict[Key, Entry] = OrderedDict()  # oldest demotion first
        self._per_ns: dict[str, int] = {}
        self.payload_bytes = 0  # of the entries held

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: object) -> bool:
        return key in self._lru

    def get(self, key: Key) -> Entry | None:
        return self._lru.get(key)

    def has_namespace(self, namespace: str) -> bool:
        return namespace in self._per_ns

    def entries(self) -> list[Entry]:
        return list(self._lru.values())

    @property
    def num_free(self) -> int:
        return len(self._free)

    def add(self, meta: SlotMeta, staging: bytes | None,
            slot: int | None = None) -> tuple[Entry, list[Entry]]:
        """A new newest entry (in `slot`, else a free one, evicting the oldest entries when none
        is free). Returns it and the entries evicted for it. The caller made sure the key is
        not held."""
        evicted = []
        if slot is None:
            while not self._free:
                evicted.append(self._pop_oldest())
            slot = self._free.pop()
            self._free_set.discard(slot)
        entry = Entry(meta, slot, staging)
        self._lru[(meta.namespace, meta.hash)] = entry
        self._count(entry)
        return entry, evicted

    def _count(self, entry: Entry) -> None:
        self._per_ns[entry.meta.namespace] = self._per_ns.get(entry.meta.namespace, 0) + 1
        self.payload_bytes += entry.meta.payload_len

    def load(self, found: list[tuple[int, SlotMeta]]) -> None:
        """Fill an empty index with (slot, meta) found on disk, oldest first."""
        held = {slot for slot, _ in found}
        self._free = [s for s in range(self.capacity - 1, -1, -1) if s not in held]
        self._free_set = set(self._free)
        for slot, meta in found:
            self.add(meta, None, slot=slot)

    def _pop_oldest(self) -> Entry:
        _, entry = self._lru.popitem(last=False)
        self._forget(entry)
        self._free.append(entry.slot)
        self._free_set.add(entry.slot)
        return entry

    def _forget(self, entry: Entry) -> None:
        entry.pending = None  # (a copy not made yet is not written: its slot is another's)
        ns = entry.meta.namespace
        self.payload_bytes -= entry.meta.payload_len
        left = self._per_ns[ns] - 1
        if left:
            self._per_ns[ns] = left
        else:
            del self._per_ns[ns]

    def is_free(self, slot: int) -> bool:
        return slot in self._free_set

    def put_back(self, entry: Entry) -> bool:
        """A promotion's entry back, as the newest, if its slot is still free (no demotion
        took it meanwhile, so it still holds the block) and its key is not held; False if
        not."""
        key = (entry.meta.namespace, entry.meta.hash)
        if entry.slot not in self._free_set or key in self._lru:
            return False
        self._free.remove(entry.slot)
        self._free_set.discard(entry.slot)
        self._lru[key] = entry
        self._count(entry)
        return True

    def drop(self, key: Key) -> Entry | None:
        entry = self._lru.pop(key, None)
        if entry is not None:
            self._forget(entry)
            self._free.append(entry.slot)
            self._free_set.add(entry.slot)
        return entry

    def drop_namespace(self, namespace: str) -> list[Entry]:
        keys = [k for k in self._lru if k[0] == namespace]
        return [e for k in keys if (e := self.drop(k)) is not None]

    def check(self) -> str | None:
        """None, or the first invariant that fails: every slot held or free, once."""
        held = [e.slot for e in self._lru.values()]
        if len(held) + len(self._free) != self.capacity:
            return (f"disk slots: {len(held)} held + {len(self._free)} free "
                    f"!= {self.capacity}")
        if set(self._free) != self._free_set or len(self._free_set) != len(self._free):
            return "the disk tier's free slot list and set disagree"
        if len(set(held) | set(self._free)) != len(held) + len(self._free):
            return "a disk slot is both held and free, or held twice"
        if sum(self._per_ns.values()) != len(self._lru):
            return "per-namespace disk counts are off"
        if sum(e.meta.payload_len for e in self._lru.values()) != self.payload_bytes:
            return "the disk tier's byte count is off"
        return None
