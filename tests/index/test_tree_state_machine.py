"""The radix tree against a plain reference model, driven by a hypothesis state machine.

The model is a dict from cached block prefixes (tuples of block codes) to a per-block entry:
block id, lock count, hits and the logical tick of the last touch. It knows nothing of edges or
splits. Eviction in the model is per block: the unlocked childless prefix with the smallest key
goes first (LRU: tick; LFU: hits, then tick), which the tree must reproduce exactly. The
adaptive policy's order depends on its own state (target split, ghosts, hints), so there the
model checks that each evicted block was an unlocked childless prefix when it went. Retention
hints are given on inserts and held handles with every policy (LRU and LFU ignore them).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixkv.index.results import BlockRemoved, BlockStored, InsertResult
from radixkv.index.tree import RadixTree
from radixkv.protocol.errors import InvalidArgument
from radixkv.protocol.tokens import to_token_bytes

BS = 4
# Block codes -> tokens. Codes 0..2 share leading tokens, so blocks differ only late or early.
BLOCK_TOKENS = {0: (0, 0, 0, 0), 1: (0, 0, 0, 1), 2: (1, 0, 0, 0), 3: (2, 2, 2, 2)}
TOKEN_BLOCK = {to_token_bytes(list(v)): k for k, v in BLOCK_TOKENS.items()}

hints = st.sampled_from([None, "session_end", "keep"])
prompts = st.tuples(
    st.lists(st.integers(0, 3), max_size=7).map(tuple),  # block codes
    st.lists(st.integers(0, 3), max_size=BS - 1),  # partial tail tokens
)

Prefix = tuple[int, ...]


@dataclass
class Entry:
    block_id: int
    tick: int
    hits: int = 0
    locks: int = 0


def key_of(blocks: Prefix, tail: list[int]) -> bytes:
    return to_token_bytes([t for b in blocks for t in BLOCK_TOKENS[b]] + tail)


class TreeMachine(RuleBasedStateMachine):
    policy = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.tree = RadixTree(BS, self.policy)
        self.model: dict[Prefix, Entry] = {}
        self.tick = 0
        self.next_id = 0
        self.free_ids: list[int] = []  # evicted ids come back, as in a pool
        self.held: list[tuple[object, Prefix]] = []  # locked handles and their matched prefix
        self.event_ids: dict[int, Prefix] = {}  # what the event stream says is cached

    # -- model helpers ---------------------------------------------------------------------

    def matched(self, blocks: Prefix) -> int:
        m = 0
        while m < len(blocks) and blocks[: m + 1] in self.model:
            m += 1
        return m

    def fresh_id(self) -> int:
        if self.free_ids:
            return self.free_ids.pop(0)
        self.next_id += 1
        return self.next_id - 1

    def touch(self, blocks: Prefix, lock: int = 0) -> None:
        self.tick += 1
        for i in range(1, len(blocks) + 1):
            e = self.model[blocks[:i]]
            e.tick = self.tick
            if lock:
                e.locks += lock
                e.hits += 1

    def victim_key(self, e: Entry) -> tuple[int, ...]:
        return (e.tick,) if self.policy == "lru" else (e.hits, e.tick)

    # -- rules ---------------------------------------------------------------------------------

    @rule(prompt=prompts, reuse=st.lists(st.booleans(), min_size=7, max_size=7), hint=hints)
    def insert(self, prompt: tuple[Prefix, list[int]], reuse: list[bool], hint: str | None) -> None:
        blocks, tail = prompt
        m = self.matched(blocks)
        ids = [self.model[blocks[: i + 1]].block_id if reuse[i] else -1 for i in range(m)]
        ids = [b if b >= 0 else self.fresh_id() for b in ids]
        ids += [self.fresh_id() for _ in range(len(blocks) - m)]
        res = self.tree.insert(key_of(blocks, tail), ids, hint)
        dups = tuple(b for i, b in enumerate(ids[:m]) if not reuse[i])
        assert res == InsertResult(tuple(ids[m:]), dups, m * BS)
        self.free_ids += dups
        for i in range(m, len(blocks)):
            self.model[blocks[: i + 1]] = Entry(ids[i], self.tick)
        if blocks:
            self.touch(blocks)

    @precondition(lambda self: len(self.model) > 0)
    @rule(prompt=prompts, pick=st.integers(0, 10**6))
    def insert_with_an_id_cached_elsewhere(
        self, prompt: tuple[Prefix, list[int]], pick: int
    ) -> None:
        blocks, tail = prompt
        if not blocks:
            return
        prefixes = sorted(self.model)
        taken = self.model[prefixes[pick % len(prefixes)]].block_id
        m = self.matched(blocks)
        pos = pick % len(blocks)
        if pos < m and self.model[blocks[: pos + 1]].block_id == taken:
            return  # that is its own position: a legal skip
        ids = [self.fresh_id() for _ in blocks]
        ids[pos] = taken
        before = list(self.tree.nodes())
        with pytest.raises(InvalidArgument, match="already cached elsewhere"):
            self.tree.insert(key_of(blocks, tail), ids)
        assert list(self.tree.nodes()) == before
        self.free_ids += [b for b in ids if b != taken]

    @rule(prompt=prompts, lock=st.booleans())
    def match_and_maybe_lock(self, prompt: tuple[Prefix, list[int]], lock: bool) -> None:
        blocks, tail = prompt
        m = self.matched(blocks)
        res = self.tree.match(key_of(blocks, tail))
        assert res.num_tokens == m * BS
        assert res.block_ids == tuple(self.model[blocks[: i + 1]].block_id for i in range(m))
        if not lock or m == 0:
            if m:
                with pytest.raises(InvalidArgument, match="without a matching lock"):
                    self.tree.unlock(res.handle)
            return
        self.tree.lock(res.handle)
        self.touch(blocks[:m], lock=1)
        self.held.append((res.handle, blocks[:m]))

    @precondition(lambda self: len(self.held) > 0)
    @rule(pick=st.integers(0, 10**6), relock=st.booleans())
    def unlock(self, pick: int, relock: bool) -> None:
        handle, prefix = self.held[pick % len(self.held)]
        if relock:  # a locked handle may be locked again, even after other mutations
            self.tree.lock(handle)
            self.touch(prefix, lock=1)
            self.held.append((handle, prefix))
            return
        self.held.remove((handle, prefix))
        self.tree.unlock(handle)
        for i in range(1, len(prefix) + 1):
            self.model[prefix[:i]].locks -= 1

    @precondition(lambda self: len(self.held) > 0)
    @rule(pick=st.integers(0, 10**6), hint=hints)
    def hint_held(self, pick: int, hint: str | None) -> None:
        self.tree.hint(self.held[pick % len(self.held)][0], hint)  # no change the model sees

    def is_victim(self, p: Prefix) -> bool:
        return self.model[p].locks == 0 and not any(p + (c,) in self.model for c in BLOCK_TOKENS)

    @rule(num_blocks=st.integers(0, 12))
    def evict(self, num_blocks: int) -> None:
        if self.policy == "adaptive":
            freed = self.tree.evict(num_blocks)
            where = {e.block_id: p for p, e in self.model.items()}
            for b in freed:
                assert self.is_victim(where[b]), f"block {b} was not an evictable leaf"
                del self.model[where[b]]
            assert len(freed) == min(num_blocks, sum(e.locks == 0 for e in self.model.values())
                                     + len(freed))
            self.free_ids += freed
            return
        expected = []
        while len(expected) < num_blocks:
            leaves = [
                p
                for p, e in self.model.items()
                if e.locks == 0 and not any(p + (c,) in self.model for c in BLOCK_TOKENS)
            ]
            if not leaves:
                break
            keys = sorted(self.victim_key(self.model[p]) for p in leaves)
            assert len(keys) < 2 or keys[0] != keys[1], "ties among leaves: the model is ambiguous"
            victim = min(leaves, key=lambda p: self.victim_key(self.model[p]))
            expected.append(self.model.pop(victim).block_id)
        assert self.tree.evict(num_blocks) == expected
        self.free_ids += expected

    @precondition(lambda self: self.policy != "adaptive")
    @rule(num_blocks=st.integers(1, 12))
    def evict_one_leaf(self, num_blocks: int) -> None:
        """max_leaves=1 trims only the first victim: a prefix of what evict() would free,
        from one edge (its blocks share the victim's key), and at least one block if any."""
        model, expected = dict(self.model), []
        while len(expected) < num_blocks:
            leaves = [p for p, e in model.items()
                      if e.locks == 0 and not any(p + (c,) in model for c in BLOCK_TOKENS)]
            if not leaves:
                break
            victim = min(leaves, key=lambda p: self.victim_key(model[p]))
            expected.append((model.pop(victim).block_id, victim))
        got = self.tree.evict(num_blocks, max_leaves=1)
        assert got == [b for b, _ in expected[:len(got)]]
        assert bool(got) == bool(expected)
        where = {e.block_id: p for p, e in self.model.items()}
        keys = {self.victim_key(self.model[where[b]]) for b in got}
        assert len(keys) <= 1, f"one leaf's blocks share one key, got {keys}"
        for b in got:
            del self.model[where[b]]
        self.free_ids += got

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def tree_equals_model(self) -> None:
        self.tree.check_integrity()
        seen: dict[Prefix, tuple[int, int, int]] = {}
        path: dict[int, Prefix] = {}
        for v in self.tree.nodes():
            prefix = () if v.parent_id is None else path[v.parent_id]
            for i, block_id in enumerate(v.block_ids):
                block = v.tokens[i * BS * 4 : (i + 1) * BS * 4]
                prefix = prefix + (TOKEN_BLOCK[block],)
                seen[prefix] = (block_id, v.lock_count, v.hits)
            path[v.node_id] = prefix
        assert seen == {p: (e.block_id, e.locks, e.hits) for p, e in self.model.items()}
        s = self.tree.stats()
        assert s.num_cached_blocks == len(self.model)
        assert s.num_locked_blocks == sum(e.locks > 0 for e in self.model.values())
        assert s.num_evictable_blocks == s.num_cached_blocks - s.num_locked_blocks
        assert s.max_depth_blocks == max(map(len, self.model), default=0)

    @invariant()
    def events_replay_to_the_cached_set(self) -> None:
        for ev in self.tree.take_events():
            if isinstance(ev, BlockStored):
                prefix = () if ev.parent_block_id is None else self.event_ids[ev.parent_block_id]
                assert len(ev.tokens) == len(ev.block_ids) * BS * 4
                for i, block_id in enumerate(ev.block_ids):
                    prefix = prefix + (TOKEN_BLOCK[ev.tokens[i * BS * 4 : (i + 1) * BS * 4]],)
                    assert self.model[prefix].block_id == block_id
                    self.event_ids[block_id] = prefix
            else:
                assert isinstance(ev, BlockRemoved)
                for block_id in ev.block_ids:
                    del self.event_ids[block_id]
        assert sorted(self.event_ids) == sorted(e.block_id for e in self.model.values())


class LFUTreeMachine(TreeMachine):
    policy = "lfu"


class AdaptiveTreeMachine(TreeMachine):
    policy = "adaptive"


TestTreeLRU = TreeMachine.TestCase
TestTreeLFU = LFUTreeMachine.TestCase
TestTreeAdaptive = AdaptiveTreeMachine.TestCase
