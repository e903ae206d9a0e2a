"""The two-part (full + window) radix tree against a simple reference: a dict from each cached
block's path to its parts, with the resumable depth recomputed from scratch."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixkv.index.results import WindowRemoved, WindowStored
from radixkv.index.window_tree import WindowedRadixTree
from radixkv.protocol.errors import InvalidArgument
from radixkv.protocol.limits import HOLE

B = 2
Path = tuple[tuple[int, ...], ...]


def blocks(tokens: list[int]) -> Path:
    return tuple(tuple(tokens[i:i + B]) for i in range(0, len(tokens) - len(tokens) % B, B))


class Reference:
    def __init__(self, wb: int) -> None:
        self.wb = wb
        self.parts: dict[Path, list[int | None]] = {}  # path -> [full, window or None]

    def cached_depth(self, path: Path) -> int:
        d = 0
        while d < len(path) and path[:d + 1] in self.parts:
            d += 1
        return d

    def resumable(self, path: Path) -> int:
        best = 0
        for d in range(1, self.cached_depth(path) + 1):
            w = min(d, self.wb)
            if all(self.parts[path[:i + 1]][1] is not None for i in range(d - w, d)):
                best = d
        return best

    def leaves_below(self, p: Path) -> list[int]:
        return [len(q) for q in self.parts if q[:len(p)] == p
                and not any(r[:len(q)] == q and len(r) > len(q) for r in self.parts)]

    def protected(self, p: Path) -> bool:
        i = len(p) - 1
        return any(i >= depth - self.wb for depth in self.leaves_below(p))


tokens_st = st.lists(st.integers(1, 3), min_size=0, max_size=14)


class WindowTreeMachine(RuleBasedStateMachine):
    @initialize(wb=st.integers(1, 3))
    def setup(self, wb: int) -> None:
        self.tree = WindowedRadixTree(B, wb)
        self.ref = Reference(wb)
        self.ids = itertools.count(0)
        self.wids = itertools.count(100_000)
        self.locked: list[tuple[object, Path]] = []

    def locked_block(self, p: Path) -> bool:
        return any(q[:len(p)] == p for _, q in self.locked)

    @rule(tokens=tokens_st, k=st.integers(0, 8), reuse=st.booleans(), hole=st.booleans())
    def insert(self, tokens: list[int], k: int, reuse: bool, hole: bool) -> None:
        path = blocks(tokens)
        k = min(k, len(path))
        ids = [next(self.ids) for _ in path]
        if reuse:  # pass the cached ids for the cached prefix, as an engine does
            for i in range(self.ref.cached_depth(path)):
                ids[i] = self.ref.parts[path[:i + 1]][0]  # type: ignore[call-overload]
        wins = [HOLE if hole and i % 2 else next(self.wids) for i in range(k)]
        res = self.tree.insert(tokens, ids, window_ids=wins)
        adopted, dups = set(), set()
        for i in range(len(path)):
            key = path[:i + 1]
            w = wins[i - (len(path) - k)] if i >= len(path) - k else None
            w = None if w == HOLE else w
            if key not in self.ref.parts:
                self.ref.parts[key] = [ids[i], w]
                adopted.add(ids[i])
                if w is not None:
                    adopted.add(w)
                continue
            part = self.ref.parts[key]
            if part[0] != ids[i]:
                dups.add(ids[i])
            if w is not None:
                if part[1] is None:
                    part[1] = w
                    adopted.add(w)
                elif part[1] != w:
                    dups.add(w)
        assert set(res.adopted) == adopted
        assert set(res.duplicates) == dups
        for ev in self.tree.take_events():
            if isinstance(ev, WindowStored):
                assert set(ev.window_ids) <= adopted

    @rule(tokens=tokens_st)
    def match(self, tokens: list[int]) -> None:
        path = blocks(tokens)
        m = self.tree.match(tokens)
        d = self.ref.resumable(path)
        assert m.num_tokens == d * B
        assert m.full_tokens == self.ref.cached_depth(path) * B
        assert list(m.block_ids) == [self.ref.parts[path[:i + 1]][0] for i in range(d)]
        w = min(d, self.ref.wb)
        assert list(m.window_ids) == [self.ref.parts[path[:i + 1]][1] for i in range(d - w, d)]

    @rule(tokens=tokens_st)
    def lock(self, tokens: list[int]) -> None:
        m = self.tree.match(tokens)
        if m.num_tokens:
            self.tree.lock(m.handle)
            self.locked.append((m.handle, blocks(tokens)[:m.num_tokens // B]))

    @precondition(lambda self: self.locked)
    @rule(i=st.integers(0, 100))
    def unlock(self, i: int) -> None:
        handle, _ = self.locked.pop(i % len(self.locked))
        self.tree.unlock(handle)

    @rule(n=st.integers(0, 6))
    def evict(self, n: int) -> None:
        freed = self.tree.evict(n)
        by_id = {part[0]: p for p, part in self.ref.parts.items()}
        full = [b for b in freed if b in by_id]
        assert len(full) <= n
        gone = {by_id[b] for b in full}
        windows = {self.ref.parts[p][1] for p in gone} - {None}
        assert set(freed) - set(full) == windows
        for p in gone:
            assert not self.locked_block(p)
            del self.ref.parts[p]
        for p in self.ref.parts:
            assert len(p) == 1 or p[:-1] in self.ref.parts
        if len(full) < n:  # nothing evictable is left
            for p in self.ref.parts:
                assert self.locked_block(p) or self.ref.leaves_below(p) != [len(p)]
        self.tree.take_events()

    @rule(n=st.integers(0, 6))
    def evict_windows(self, n: int) -> None:
        before = {p: part[1] for p, part in self.ref.parts.items()}
        freed = self.tree.evict_windows(n)
        assert len(freed) <= n
        by_window = {w: p for p, w in before.items() if w is not None}
        for w in freed:
            p = by_window[w]
            assert not self.locked_block(p), "freed a pinned window part"
            assert not self.ref.protected(p), "freed a window part inside a leaf's tail window"
        for w in freed:
            self.ref.parts[by_window[w]][1] = None
        if len(freed) < n:
            for p, part in self.ref.parts.items():
                assert part[1] is None or self.locked_block(p) or self.ref.protected(p)
        events = self.tree.take_events()
        if freed:
            assert [ev.window_ids for ev in events if isinstance(ev, WindowRemoved)] \
                == [tuple(freed)]

    @invariant()
    def integrity(self) -> None:
        if hasattr(self, "tree"):
            self.tree.check_integrity()
            assert self.tree.num_cached_blocks == len(self.ref.parts)
            assert self.tree.num_window_blocks == sum(
                part[1] is not None for part in self.ref.parts.values())


WindowTreeMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                               deadline=None)
test_window_tree_machine = WindowTreeMachine.TestCase


def test_branch_tail_window_is_protected() -> None:
    """Window eviction never frees a branch's last window: the branch stays resumable at its
    end until the leaf itself goes; the shared trunk's windows outside it go first."""
    tree = WindowedRadixTree(B, 2)
    trunk = [1, 1, 2, 2, 3, 3, 1, 2]  # 4 blocks
    a, b = trunk + [3, 1, 3, 3], trunk + [2, 1, 2, 2]  # two branches of 2 blocks each
    tree.insert(a, [0, 1, 2, 3, 4, 5], window_ids=[10, 11, 12, 13, 14, 15])
    tree.insert(b, [0, 1, 2, 3, 6, 7], window_ids=[12, 13, 16, 17])
    assert tree.evict_windows(10) == [10, 11, 12, 13]  # the trunk: outside both tails
    for branch in (a, b):  # each branch's last 2 window parts stayed
        assert tree.match(branch).num_tokens == len(branch)
    assert tree.match(trunk + [1, 1]).num_tokens == 0
    assert tree.evict(2) == [5, 4, 15, 14]  # the older branch goes, both parts
    assert tree.evict_windows(10) == []  # b's tail is still protected
    assert tree.match(b).window_ids == (16, 17)
    tree.check_integrity()


def test_match_skips_back_over_a_hole() -> None:
    tree = WindowedRadixTree(B, 2)
    t = [1, 1, 2, 2, 3, 3, 1, 1, 2, 2]  # 5 blocks
    tree.insert(t, [0, 1, 2, 3, 4], window_ids=[10, 11])  # windows only on blocks 3, 4
    m = tree.match(t)
    assert (m.num_tokens, m.block_ids, m.window_ids) == (10, (0, 1, 2, 3, 4), (10, 11))
    assert tree.match(t[:8]).num_tokens == 0  # d = 4 needs blocks 2, 3, ... d = 1 block 0
    tree.insert(t[:6], [0, 1, 2], window_ids=[20])  # revive block 2's window
    assert tree.match(t[:8]).window_ids == (20, 10)
    tree.check_integrity()


def test_bad_window_input() -> None:
    tree = WindowedRadixTree(B, 2)
    with pytest.raises(InvalidArgument, match="window parts for 2 full blocks"):
        tree.insert([1, 2, 3, 4], [0, 1], window_ids=[5, 6, 7])
    with pytest.raises(InvalidArgument, match="both a full part and a window part"):
        tree.insert([1, 2, 3, 4], [0, 1], window_ids=[1])
    tree.insert([1, 2, 3, 4], [0, 1], window_ids=[5])
    with pytest.raises(InvalidArgument, match="already cached elsewhere"):
        tree.insert([4, 4, 4, 4], [2, 3], window_ids=[5])
    with pytest.raises(InvalidArgument, match="cached as a window part"):
        tree.insert([4, 4, 4, 4], [5, 3])
    with pytest.raises(InvalidArgument, match="window_blocks"):
        WindowedRadixTree(B, 0)
    assert tree.match([1, 2, 3, 4]).num_tokens == 0  # block 0 has no window part
    assert tree.match([1, 2, 3, 4]).window_ids == ()
    tree.check_integrity()
