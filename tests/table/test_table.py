"""The lookup table in one process: a hypothesis state machine drives a real KVService (its event
log feeding the table) through stores, evictions, Clears and the disk tier, and after every step
each prompt's peek equals what a Match finds; the bytes' layout and the read protocol's edges."""

from __future__ import annotations

import os
import stat
import subprocess
import tempfile

import numpy as np
import pytest
from _kv import BS, fill, make_service, toks
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from radixkv.disk.directory import open_disk_tier
from radixkv.protocol.block_hashes import path_keys, token_keys
from radixkv.protocol.errors import StalePool
from radixkv.service.table_writer import TableWriter
from radixkv.table import table_format as L
from radixkv.table.reader import TableReader

pytestmark = pytest.mark.skipif(not L.supported(), reason="the table is published on x86-64")

# prompts that share prefixes: 3 stems x 3 tails, 2-4 blocks of 4 tokens each
STEMS = [list(range(s * 100, s * 100 + 8)) for s in range(3)]
PROMPTS = [stem + list(range(1000 + t * 10, 1000 + t * 10 + 4 * (t % 2 + 1)))
           for stem in STEMS for t in range(3)]
NAMESPACES = ["a", "b"]


def published(svc, entries: int = 64) -> tuple[TableWriter, TableReader]:
    table = TableWriter(entries, BS, svc.epoch)
    svc.events.follow(table)
    return table, TableReader(table.segment.name, table.segment.nbytes, svc.epoch)


class TableMachine(RuleBasedStateMachine):
    """Every answer of the table equals the Match's, over stores, evictions (to the disk tier
    where there is one, and dropped from it), promotions and Clears."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.TemporaryDirectory(prefix="rkv-table-")
        self.svc = make_service(num_blocks=12, lease_ttl_s=60)
        self.disk = False

    @initialize(disk=st.booleans())
    def start(self, disk: bool) -> None:
        if disk:  # a disk tier of 10 blocks below the pool: demotions, promotions, drops
            pool = self.svc.pool
            self.svc.pool = None  # type: ignore[assignment]
            from radixkv.service import KVService, ServiceConfig

            tier = open_disk_tier(pool, self.dir.name, 10, 1 << 20)
            self.svc = KVService(pool, ServiceConfig(lease_ttl_s=60), tier=tier)
            self.disk = True
        self.table, self.reader = published(self.svc)

    @rule(ns=st.sampled_from(NAMESPACES), i=st.integers(0, len(PROMPTS) - 1))
    def store(self, ns: str, i: int) -> None:
        fill(self.svc, ns, toks(*PROMPTS[i]))

    @rule(n=st.integers(1, 12))
    def press(self, n: int) -> None:
        """Lease n blocks and give them back: the pool evicts (demotes) to make room."""
        a = self.svc.allocate("x", None, "scratch", n)
        self.svc.release("x", [a.lease_id])

    @rule(ns=st.sampled_from(NAMESPACES))
    def clear(self, ns: str) -> None:
        try:
            self.svc.clear(ns)
        except Exception as e:  # noqa: BLE001 - NotFound: nothing cached there yet
            assert type(e).__name__ == "NotFound"

    @invariant()
    def peeks_equal_matches(self) -> None:
        if not hasattr(self, "table"):
            return
        for ns in NAMESPACES:
            for p in PROMPTS:
                peek = self.reader.peek(ns, np.asarray(p, np.uint32))
                pool_run = (peek.num_pool_blocks, peek.block_ids)
                m = self.svc.match("r", ns, toks(*p))  # promotes what is on disk
                self.svc.release("r", [m.lease_id])
                assert peek.num_blocks == len(m.block_ids), (ns, p, peek, m)
                if not self.disk:
                    assert pool_run == (len(m.block_ids), m.block_ids), (ns, p, peek, m)
                again = self.reader.peek(ns, np.asarray(p, np.uint32))
                assert (again.num_pool_blocks, again.block_ids) == (len(m.block_ids),
                                                                    m.block_ids)

    def teardown(self) -> None:
        if hasattr(self, "table"):
            self.svc.check_integrity()
            self.svc.events.follow(None)
            self.reader.close()
            self.table.close()
        self.svc.close_tier(write_down=False)
        self.svc.pool.close()
        self.dir.cleanup()


TestTableMachine = TableMachine.TestCase
TestTableMachine.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)


def test_key_path_keys_and_token_keys_are_the_event_hashes(svc):
    table, reader = published(svc)
    p = toks(*range(12))
    fill(svc, "ns", p)
    events, _ = svc.events.read(0)
    tokens = np.frombuffer(p, np.uint32)
    assert token_keys("ns", tokens, BS).tolist() == list(events[0].block_hashes)
    keys = [bytes(range(i, i + 8)) for i in range(3)]
    m = svc.match("e", "k", b"".join(keys), key_size=8)
    a = svc.allocate("e", m.lease_id, "k", 3)
    svc.insert("e", m.lease_id, "k", b"".join(keys), a.block_ids, key_size=8)
    svc.release("e", [m.lease_id])
    assert path_keys("k", keys).tolist() == list(svc.events.read(1)[0][-1].block_hashes)
    assert reader.peek_keys("k", keys).block_ids == a.block_ids
    assert reader.peek_keys("k", keys[:1] + keys[2:]).num_blocks == 1
    svc.events.follow(None)
    reader.close()
    table.close()


def test_segment_is_private_and_read_only_for_readers(svc):
    table, reader = published(svc)
    mode = stat.S_IMODE(os.stat(table.segment.path).st_mode)
    assert mode == 0o600
    with pytest.raises(TypeError):
        reader.mm[0] = 1  # mapped read-only: a reader cannot change what others read
    reader.close()
    table.close()
    assert not os.path.exists(table.segment.path)


def test_a_bucket_left_in_change_is_a_miss_never_a_torn_entry(svc):
    """A writer killed between a bucket's two counter bumps leaves it odd: its keys are misses
    after TRIES reads; the closed table is stale for readers."""
    table, reader = published(svc)
    fill(svc, "ns", toks(*range(8)))
    tokens = np.arange(8, dtype=np.uint32)
    assert reader.peek("ns", tokens).num_blocks == 2
    key = int(token_keys("ns", tokens, BS)[1])
    base = L.HEADER_BYTES // 8 + (key & (table.num_buckets - 1)) * L.BUCKET_WORDS
    words = table._words
    words[base] += 1  # the writer "dies" mid-change: odd, and a way half written
    words[table._where[key] + L.WAYS] = L.value(99, L.POOL, 0)
    before = reader.retries
    assert reader.peek("ns", tokens).num_blocks == 1  # the block in change: a miss
    assert reader.gave_up == 1
    assert reader.retries - before == (1024 if reader._native else 8 * 2)  # one bucket / all
    words[base] += 1
    assert reader.peek("ns", tokens).block_ids == (0, 99)  # (what the "writer" wrote)
    table.close()
    with pytest.raises(StalePool, match="closed"):
        reader.peek("ns", tokens)
    reader.close()


def test_full_bucket_drops_the_key_as_a_miss():
    table = TableWriter(8, BS, "e" * 32)
    mask = table.num_buckets - 1
    keys = [(i << 20) | 5 for i in range(1, L.WAYS + 3)]  # all in bucket 5
    assert {k & mask for k in keys} == {5}
    for k in keys:
        table.put("ns", k, L.value(1, L.POOL, 1))
    assert (table.num_keys, table.overflows) == (L.WAYS, 2)
    reader = TableReader(table.segment.name, table.segment.nbytes, "e" * 32)
    n, values = reader.lookup(np.asarray(keys, np.uint64))
    assert n == L.WAYS
    table.remove("ns", keys[0])
    table.put("ns", keys[-1], L.value(2, L.POOL, 1))  # room again
    assert reader.lookup(np.asarray(keys[-1:], np.uint64))[0] == 1
    reader.close()
    table.close()


def test_a_killed_services_table_is_reclaimed_by_the_next_table():
    """A table segment whose owner died (pid gone, flock free) is unlinked when the next table
    of that prefix is made, whatever the pool's backend."""
    done = subprocess.Popen(["true"])
    done.wait()
    stale = f"/dev/shm/rkvtest-table-{done.pid}-{'c' * 32}"
    with open(stale, "wb"):
        pass
    table = TableWriter(8, BS, "e" * 32, prefix="rkvtest-table")
    assert not os.path.exists(stale)
    assert os.path.exists(table.segment.path)
    table.close()
    assert not os.path.exists(table.segment.path)


def test_reader_refuses_another_epochs_table(svc):
    table, reader = published(svc)
    with pytest.raises(StalePool, match="not that of pool epoch"):
        TableReader(table.segment.name, table.segment.nbytes, "0" * 32)
    reader.close()
    table.close()
