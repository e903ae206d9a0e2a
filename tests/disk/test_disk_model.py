"""The pool and its disk tier against a reference (hypothesis, in-process): requests over prompts
that share prefixes, clean restarts and restarts that lose the pool, on a tiny pool with a disk
tier that may or may not hold everything. The reference is a dict from each prefix ever stored
to the tier it must be in (or may be in); after every step the service's trees and disk index
are read back and compared: every block is in exactly one of free / leased / memory / disk
(the integrity check), no prefix is in both tiers, the counts and bytes per tier are exact,
every hit's bytes are the KV written for that prefix (real bytes compared), and while the two
tiers together can hold everything, nothing stored is ever lost or missed; Clear empties
both. A Match can be stopped while its blocks come up from disk: then they are reserved (free
+ reserved + leased + memory + disk covers every block once), and a slot corrupted before the
read is a counted miss whose reserved blocks go back to free."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpool import create_pool
from kvpool.layout import KVLayout
from radixkv.disk.promotion import Promotion
from radixkv.disk.slots import FILE_NAME, ZERO_HASH, chain_hash
from radixkv.disk.tier import DiskTier
from radixkv.protocol import errors
from radixkv.service import KVService, ServiceConfig

BS = 4
POOL = 6
NS = "ns"
Prompt = tuple[int, ...]  # one segment id per block


def tokens_of(prompt: Prompt) -> bytes:
    return np.asarray([s * 10 + t for s in prompt for t in range(BS)], "<u4").tobytes()


def kv_of(prefix: Prompt) -> np.ndarray:
    """The bytes the block ending `prefix` holds (128-byte blocks)."""
    digest = hashlib.sha256(repr(prefix).encode()).digest()
    return np.frombuffer(digest * 4, np.uint8)


class GatedTier(DiskTier):
    """The disk tier, its promotions' reads held at a gate while the test looks at the service
    (blocks reserved, entries off the index): the real tier, stopped at one point."""

    gate: threading.Event | None = None
    reading = threading.Event()
    plans: list[Promotion] = []

    def read(self, plans: Any) -> None:
        if self.gate is not None:
            self.plans = list(plans)
            self.reading.set()
            self.gate.wait(30)
        super().read(plans)


class PoolAndDisk(RuleBasedStateMachine):
    @initialize(disk=st.sampled_from([3, 8, 64]))
    def start(self, disk: int) -> None:
        self.dir = tempfile.mkdtemp(prefix="rkv-model-")
        self.disk = disk
        self.known: set[Prompt] = set()  # every prefix stored and not lost with a pool
        self.in_memory: set[Prompt] = set()  # prefixes that must be in the pool now
        self.lossless = True  # the tiers have held everything stored so far
        self._open()

    def _open(self) -> None:
        self.pool = create_pool(KVLayout(1, 1, 4, "fp32", BS), num_blocks=POOL)
        self.tier = GatedTier(self.pool, self.dir, self.disk)
        self.svc = KVService(self.pool, ServiceConfig(lease_ttl_s=60, policy="lru"),
                             tier=self.tier)

    def teardown(self) -> None:
        self.svc.close_tier(write_down=False)
        self.pool.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # ---- rules -------------------------------------------------------------------------------

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=3).map(tuple))
    def request(self, prompt: Prompt) -> None:
        tokens = tokens_of(prompt)
        m = self.svc.match("e", NS, tokens)
        for j, b in enumerate(m.block_ids):  # every hit block holds its prefix's KV, exactly
            assert np.array_equal(self.pool.block_bytes(b), kv_of(prompt[:j + 1]))
        cached = [prompt[:j] for j in range(1, len(prompt) + 1) if prompt[:j] in self.known]
        if self.lossless:  # nothing stored was lost: the match is the longest stored prefix
            assert len(m.block_ids) == len(cached), (prompt, m.block_ids, cached)
        need = len(prompt) - len(m.block_ids)
        new = self.svc.allocate("e", m.lease_id, NS, need).block_ids if need else ()
        for j, b in enumerate(new, len(m.block_ids)):
            self.pool.block_bytes(b)[:] = kv_of(prompt[:j + 1])
        self.svc.insert("e", m.lease_id, NS, tokens, m.block_ids + new)
        self.svc.release("e", [m.lease_id])
        self.known.update(prompt[:j] for j in range(1, len(prompt) + 1))
        self.in_memory = {prompt[:j] for j in range(1, len(prompt) + 1)}
        if len(self.known) > POOL + self.disk:
            self.lossless = False

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=3).map(tuple),
          torn=st.booleans(), which=st.integers(0, 2))
    def match_while_reading(self, prompt: Prompt, torn: bool, which: int) -> None:
        """A Match stopped while its blocks come up from disk: they are reserved (neither
        free, leased nor cached, in no tree) and the integrity check counts them; with `torn`,
        a block's slot is corrupted before the read: it is a counted miss, its
        reserved blocks go back to free, the blocks before it are served, and no wrong KV is
        (the plan's last block is corrupted too: a prompt's slots are often in reverse order,
        and a run read in slot order must check each block, not stop at its first failure)."""
        self.tier.flush()  # every demotion written: the read goes to the file
        self.tier.gate, self.tier.reading = threading.Event(), threading.Event()
        out: dict[str, Any] = {}

        def match() -> None:
            try:
                out["m"] = self.svc.match("e", NS, tokens_of(prompt))
            except BaseException as e:  # noqa: BLE001 - re-raised below
                out["e"] = e

        thread = threading.Thread(target=match)
        thread.start()
        while not self.tier.reading.wait(0.01) and thread.is_alive():
            pass
        bad, failures, cached = None, self.svc.stats().disk.verify_failures, -1
        if self.tier.reading.is_set():
            plan = self.tier.plans[0]
            cached = plan.cached
            self.svc.check_integrity()  # free + leased + cached + reserved == pool
            assert self.tier.reserved_blocks == len(plan.ids) > 0
            assert not any(self.pool.is_free(b) for b in plan.ids)
            nodes, _ = self.svc.dump_tree(NS) if NS in self.svc.namespaces() else ([], 0)
            assert {b for n in nodes for b in n.block_ids}.isdisjoint(plan.ids)
            assert not any((e.meta.namespace, e.meta.hash) in self.tier.index
                           for e in plan.taken)  # neither on disk nor in memory: coming up
            if torn:  # that block and the plan's last (two failures in one read)
                which = min(which, len(plan.views) - 1)
                fd = os.open(os.path.join(self.dir, FILE_NAME), os.O_RDWR)
                try:
                    for i in {which, len(plan.views) - 1}:
                        at = (self.tier.file.offset(plan.taken[i].slot)
                              + self.tier.file.geometry.meta_bytes)
                        os.pwrite(fd, bytes(b ^ 0xFF for b in os.pread(fd, 4, at)), at)
                finally:
                    os.close(fd)
                bad = prompt[:cached + which + 1]
        self.tier.gate.set()
        thread.join()
        self.tier.gate = None
        if "e" in out:
            raise out["e"]
        m = out["m"]
        for j, b in enumerate(m.block_ids):
            assert np.array_equal(self.pool.block_bytes(b), kv_of(prompt[:j + 1]))
        if bad is not None:
            assert len(m.block_ids) == len(bad) - 1
            assert self.svc.stats().disk.verify_failures == failures + 1
        elif self.lossless:
            stored = [prompt[:j] for j in range(1, len(prompt) + 1) if prompt[:j] in self.known]
            assert len(m.block_ids) == len(stored), (prompt, m.block_ids, stored)
        self.svc.release("e", [m.lease_id])
        assert self.tier.reserved_blocks == 0
        if bad is not None:  # that block is gone; what hangs below it may be unreachable
            self.known.discard(bad)
            self.lossless = False
        self.in_memory = {prompt[:j] for j in range(1, len(m.block_ids) + 1)}

    @rule()
    def clear(self) -> None:
        """Clear drops the namespace from both tiers (NotFound when it holds nothing)."""
        held = self.memory() | self.on_disk()
        if held:
            self.svc.clear(NS)
        else:
            with pytest.raises(errors.NotFound):
                self.svc.clear(NS)
        assert self.memory() == set() and self.on_disk() == set()
        self.known, self.in_memory = set(), set()
        self.lossless = True

    @rule()
    def clean_restart(self) -> None:
        """SIGTERM's path: the pool's blocks written down, the next start loads them."""
        before = self.memory() | self.on_disk()
        self.svc.close_tier(write_down=True)
        self.pool.close()
        self._open()
        assert self.memory() == set()
        if len(before) <= self.disk:
            assert self.on_disk() == before
        else:
            self.lossless = False
        self.in_memory = set()

    @precondition(lambda self: self.disk > 3)
    @rule()
    def pool_lost(self) -> None:
        """A restart that loses the pool (only what was demoted survives)."""
        before = self.on_disk()
        self.svc.close_tier(write_down=False)
        self.pool.close()
        self._open()
        assert self.on_disk() == before
        self.known = set(before)
        self.known = {p for p in before if all(p[:j] in before for j in range(1, len(p)))}
        self.lossless = self.known == before
        self.in_memory = set()

    # ---- reading the service back ------------------------------------------------------------

    def memory(self) -> set[Prompt]:
        if NS not in self.svc.namespaces():
            return set()
        nodes, _ = self.svc.dump_tree(NS)
        by_id = {n.node_id: n for n in nodes}
        out = set()
        for n in nodes:
            path, cur = [], n
            while cur is not None:
                path.append(cur.tokens)
                cur = by_id.get(cur.parent_id) if cur.parent_id is not None else None
            toks = np.frombuffer(b"".join(reversed(path)), "<u4")
            segs = tuple(int(t) // 10 for t in toks[::BS])
            out.update(segs[:j] for j in range(len(segs) - len(n.block_ids) + 1, len(segs) + 1))
        return out

    def on_disk(self) -> set[Prompt]:
        keys = {(e.meta.namespace, e.meta.hash) for e in self.tier.index.entries()}
        out, frontier = set(), [((), ZERO_HASH)]
        while frontier:  # walk every prompt the model could have stored, by chain hash
            prefix, h = frontier.pop()
            for s in range(3):
                if len(prefix) == 3:
                    break
                p = (*prefix, s)
                hp = chain_hash(h, NS, tokens_of(p)[-BS * 4:])
                if (NS, hp) in keys:
                    out.add(p)
                frontier.append((p, hp))
        assert len(out) == len(keys), "a disk entry the model never stored"
        return out

    # ---- invariants --------------------------------------------------------------------------

    @invariant()
    def tiers_agree_with_the_reference(self) -> None:
        self.svc.check_integrity()  # free + leased + cached + reserved == pool; one tier each
        mem, disk = self.memory(), self.on_disk()
        s = self.svc.stats()
        assert mem.isdisjoint(disk)
        assert len(mem) == s.cached_blocks <= POOL and len(disk) == s.disk.blocks <= self.disk
        assert s.disk.bytes == len(disk) * self.pool.layout.bytes_per_block
        assert self.in_memory <= mem  # the last request's blocks are in the pool
        assert mem | disk <= self.known | disk
        if self.lossless:
            assert mem | disk == self.known


TestPoolAndDisk = PoolAndDisk.TestCase
TestPoolAndDisk.settings = settings(max_examples=30, stateful_step_count=20, deadline=None)


def store_prompt(svc: KVService, pool: Any, prompt: tuple[int, ...]) -> None:
    """Cache `prompt`'s blocks in the pool, each holding kv_of its prefix."""
    r = svc.allocate("e", None, NS, len(prompt))
    for j, b in enumerate(r.block_ids):
        pool.block_bytes(b)[:] = kv_of(prompt[:j + 1])
    svc.insert("e", r.lease_id, NS, tokens_of(prompt), r.block_ids)
    svc.release("e", [r.lease_id])


def test_a_promotion_with_no_room_leaves_the_blocks_on_disk(tmp_path):
    """Every pool block leased: a Match whose prefix is on disk reserves nothing and misses it
    (the blocks stay on disk, no block is left reserved); once the lease ends the next Match
    brings it up, byte for byte."""
    pool = create_pool(KVLayout(1, 1, 4, "fp32", BS), num_blocks=POOL)
    tier = DiskTier(pool, str(tmp_path), 8)
    svc = KVService(pool, ServiceConfig(lease_ttl_s=60, policy="lru"), tier=tier)
    try:
        prompt = (1, 2, 0)
        store_prompt(svc, pool, prompt)
        hog = svc.allocate("e", None, "other", POOL)  # evicts (demotes) the prompt, holds all
        assert svc.stats().disk.blocks == len(prompt)
        m = svc.match("e", NS, tokens_of(prompt))
        assert len(m.block_ids) == 0 and tier.reserved_blocks == 0
        assert svc.stats().disk.blocks == len(prompt) and svc.stats().disk.promoted_blocks == 0
        svc.check_integrity()
        svc.release("e", [m.lease_id, hog.lease_id])
        m = svc.match("e", NS, tokens_of(prompt))
        assert len(m.block_ids) == len(prompt)
        for j, b in enumerate(m.block_ids):
            assert np.array_equal(pool.block_bytes(b), kv_of(prompt[:j + 1]))
        svc.release("e", [m.lease_id])
        svc.check_integrity()
    finally:
        svc.close_tier(write_down=False)
        pool.close()


def test_two_corrupt_slots_in_one_run_are_both_misses(tmp_path):
    """A prompt's blocks demoted leaf first sit in adjacent slots in reverse order, so one
    os.preadv reads them last block first: with its first and last blocks corrupted, the
    Match hits nothing from disk (each block is checked, not only up to the first failure
    in slot order), and no wrong KV is served."""
    pool = create_pool(KVLayout(1, 1, 4, "fp32", BS), num_blocks=POOL)
    tier = DiskTier(pool, str(tmp_path), 16)
    svc = KVService(pool, ServiceConfig(lease_ttl_s=60, policy="lru"), tier=tier)
    try:
        prompt = (1, 2, 0)
        store_prompt(svc, pool, prompt)
        hog = svc.allocate("e", None, "other", POOL)  # evicts (demotes) the prompt
        svc.release("e", [hog.lease_id])
        tier.flush()
        slots = [e.slot for e in sorted(tier.index.entries(), key=lambda e: e.meta.position)]
        assert slots == sorted(slots, reverse=True) and slots[0] - slots[-1] == 2  # one run
        fd = os.open(os.path.join(str(tmp_path), FILE_NAME), os.O_RDWR)
        try:
            for slot in (slots[0], slots[-1]):
                at = tier.file.offset(slot) + tier.file.geometry.meta_bytes
                os.pwrite(fd, bytes(b ^ 0xFF for b in os.pread(fd, 4, at)), at)
        finally:
            os.close(fd)
        m = svc.match("e", NS, tokens_of(prompt))
        for j, b in enumerate(m.block_ids):
            assert np.array_equal(pool.block_bytes(b), kv_of(prompt[:j + 1]))
        assert len(m.block_ids) == 0 and svc.stats().disk.verify_failures == 1
        svc.release("e", [m.lease_id])
        svc.check_integrity()
    finally:
        svc.close_tier(write_down=False)
        pool.close()
