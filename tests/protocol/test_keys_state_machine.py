"""Key-keyed namespaces (radixkv.service.keyed) as a hypothesis state machine against a dict
reference: stores and matches of block-key sequences on a small in-process service, with evictions.
The reference maps each cached key prefix to its block id; the service's events say which blocks
went, so the reference follows evictions; every match must be the reference's leading run."""

from __future__ import annotations

import hashlib

import pytest
from _kv import BS, make_service, toks
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from radixkv.protocol.errors import FailedPrecondition, InvalidArgument
from radixkv.protocol.values import InsertItem
from radixkv.protocol.wire import STORE_ALL

KEY = 32
NS = "keys"
Seq = tuple[bytes, ...]


def key(symbol: int, prev: bytes = b"") -> bytes:
    return hashlib.sha256(prev + bytes([symbol])).digest()


sequences = st.lists(st.integers(0, 2), min_size=1, max_size=5)


def as_keys(symbols: list[int], chained: bool) -> Seq:
    """Chain hashes (as SGLang's) or keys standing alone (the tree must not need chaining)."""
    out: list[bytes] = []
    for s in symbols:
        out.append(key(s, out[-1] if out and chained else b""))
    return tuple(out)


class KeyMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.svc = make_service(num_blocks=6)
        self.cached: dict[Seq, int] = {}  # the reference: key prefix -> block id
        self.seen = 0  # last event sequence applied

    def follow_events(self) -> None:
        events, lagged = self.svc.events.read(self.seen)
        assert not lagged
        for ev in events:
            self.seen = ev.sequence
            if ev.kind == "removed":
                gone = set(ev.block_ids)
                self.cached = {p: b for p, b in self.cached.items() if b not in gone}
            elif ev.kind == "stored":
                assert ev.key_size == KEY and len(ev.tokens) == KEY * len(ev.block_ids)

    def leading(self, seq: Seq) -> list[int]:
        run = []
        for i in range(1, len(seq) + 1):
            if seq[:i] not in self.cached:
                break
            run.append(self.cached[seq[:i]])
        return run

    @rule(symbols=sequences, chained=st.booleans())
    def store(self, symbols: list[int], chained: bool) -> None:
        seq = as_keys(symbols, chained)
        m = self.svc.match_many("e", [(NS, b"".join(seq))], store_tokens=[STORE_ALL],
                                key_sizes=[KEY])[0]
        self.follow_events()  # evictions made room before the answer
        assert list(m.block_ids) == self.leading(seq)
        assert m.num_tokens == len(m.block_ids) * BS
        if m.alloc_error:
            self.svc.release("e", [m.lease_id])
            return
        ids = m.block_ids + m.new_block_ids
        assert len(ids) == len(seq)
        self.svc.insert_many("e", [InsertItem(m.lease_id, NS, b"".join(seq), ids, key_size=KEY)],
                             release=[m.lease_id])
        self.follow_events()
        for i, b in enumerate(ids):
            self.cached[seq[:i + 1]] = b

    @rule(symbols=sequences, chained=st.booleans())
    def match(self, symbols: list[int], chained: bool) -> None:
        seq = as_keys(symbols, chained)
        m = self.svc.match("e", NS, b"".join(seq), key_size=KEY)
        assert list(m.block_ids) == self.leading(seq)
        self.svc.release("e", [m.lease_id])

    @rule()
    def tokens_refused_while_key_keyed(self) -> None:
        if NS not in self.svc.namespaces():
            return
        with pytest.raises(FailedPrecondition, match="key-keyed"):
            self.svc.match("e", NS, toks(1, 2, 3, 4))

    @invariant()
    def same_as_reference(self) -> None:
        self.svc.check_integrity()
        stats = self.svc.stats()
        assert stats.cached_blocks == len(self.cached) == len(set(self.cached.values()))
        assert stats.live_leases == 0


TestKeyMachine = KeyMachine.TestCase
TestKeyMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_bad_keys_are_refused_with_the_reason() -> None:
    svc = make_service()
    for data, size, message in [(b"x" * 30, 30, "multiple of 4 in 8..64"),
                                (b"x" * 4, 4, "multiple of 4 in 8..64"),
                                (b"x" * 68, 68, "multiple of 4 in 8..64"),
                                (b"x" * 40, 32, "not a whole number of 32-byte keys"),
                                (b"", 32, "empty key list")]:
        with pytest.raises(InvalidArgument, match=message):
            svc.match("e", NS, data, key_size=size)
    svc.match("e", "t", toks(1, 2, 3, 4))
    with pytest.raises(FailedPrecondition, match="is token-keyed"):
        svc.match("e", "t", b"k" * 32, key_size=32)
    svc.check_integrity()
