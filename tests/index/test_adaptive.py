"""The adaptive policy (radixkv.index.adaptive) and retention hints on tiny trees: exact victims.

Trees have block_size 1, so a prompt [1, 2, 3] is three blocks and block ids are chosen by the
test. Each case sets up leaves where LRU and adaptive disagree and checks adaptive's victim.
"""

from __future__ import annotations

import random

import pytest
from _kv import make_service, toks

from radixkv.index.adaptive import DEAD, ONCE, TWICE, AdaptivePolicy
from radixkv.index.hints import parse_hint
from radixkv.index.policies import make_policy, policy_factory
from radixkv.index.tree import RadixTree
from radixkv.protocol.errors import InvalidArgument
from radixkv.protocol.values import InsertItem
from radixkv.replay.hints import session_hints


def make_tree(policy: str = "adaptive") -> tuple[RadixTree, AdaptivePolicy]:
    p = make_policy(policy)
    return RadixTree(1, p), p  # type: ignore[return-value]


def put(tree: RadixTree, tokens: list[int], hint: str | None = None) -> None:
    """A request as the replay does it: match + lock (a hit), insert with ids = tokens, unlock."""
    m = tree.match(tokens)
    tree.lock(m.handle)
    tree.insert(tokens, tokens, hint)
    tree.unlock(m.handle)
    tree.check_integrity()


def hit(tree: RadixTree, tokens: list[int]) -> None:
    m = tree.match(tokens)
    tree.lock(m.handle)
    tree.unlock(m.handle)


def test_seen_twice_outlives_seen_once():
    for policy, victim in (("lru", [2]), ("adaptive", [4])):
        tree, _ = make_tree(policy)
        put(tree, [1, 2])
        hit(tree, [1, 2])  # A seen again: T2
        put(tree, [3, 4])  # B newer, seen once: T1; p = 0 takes T1 first
        assert tree.evict(1) == victim
        tree.check_integrity()


def test_a_pool_of_known_size_starts_with_an_even_split():
    """Until ghost hits move it, T1 may hold half the pool: a stale hit leaf goes before a newer
    seen-once one (as LRU would), instead of every seen-once leaf going first (p = 0)."""
    policy = policy_factory("adaptive", capacity_blocks=4)("")
    tree = RadixTree(1, policy)
    assert policy.state.p == 2
    put(tree, [1, 2])
    hit(tree, [1, 2])  # A seen again: T2
    put(tree, [3])  # B newer, seen once: T1 holds 1 block <= p
    assert tree.evict(1) == [2]
    for t in ([4], [5], [6]):
        put(tree, t)  # T1 now holds 4 blocks > p: it gives the victims, oldest first
    assert tree.evict(2) == [3, 4]
    tree.check_integrity()


def test_ghost_hit_promotes_and_moves_the_split():
    tree, policy = make_tree()
    put(tree, [10, 11])
    assert tree.evict(2) == [11, 10]  # T1 blocks go to B1, tail first
    assert policy.ghost_size() == 2 and policy.state.p == 0
    put(tree, [10, 11])  # back from B1: T1 was too small
    assert policy.ghost_size() == 0 and policy.state.ghost_hits == [2, 0]
    assert policy.state.p == 2  # 2 blocks x max(1, |B2| / |B1|)
    leaf = next(iter(tree._root.children.values()))
    assert leaf.promoted and AdaptivePolicy.list_of(leaf) == TWICE
    put(tree, [20])  # T1 holds 1 block <= p = 2: now T2 gives the victim
    assert tree.evict(1) == [11]
    assert policy.ghost_size() == 1  # 11 went to B2
    put(tree, [10, 11])  # back from B2: T2 was too small, p shrinks
    assert policy.state.ghost_hits == [2, 1] and policy.state.p == 1
    tree.check_integrity()


def test_ghosts_are_bounded_and_counted():
    policy = policy_factory("adaptive", capacity_blocks=3)("")
    tree = RadixTree(1, policy)
    for i in range(20):
        put(tree, [100 + i])
        tree.evict(1)
    assert policy.ghost_size() == 6  # B1 holds at most 2 x capacity


def test_lineage_admits_later_turns():
    tree, policy = make_tree()
    put(tree, [1])  # turn 1
    put(tree, [1, 2])  # turn 2 extends 1 earlier request: seen once
    put(tree, [1, 2, 3])  # turn 3 extends 2: admitted to T2
    assert policy.state.lineage_admits == 1
    put(tree, [9])  # an unrelated newer prompt: T1
    assert tree.evict(1) == [9]  # LRU would take 3
    lru, _ = make_tree("lru")
    for p in ([1], [1, 2], [1, 2, 3], [9]):
        put(lru, p)
    assert lru.evict(1) == [3]


def test_session_end_demotes_the_unique_tail_and_its_path():
    tree, _ = make_tree()
    put(tree, [1, 2])  # an older session, seen once
    put(tree, [5])
    put(tree, [5, 6], "session_end")  # ends: 6 and its single-child ancestor 5 go first
    assert tree.evict(1) == [6]
    assert tree.evict(1) == [5]
    assert tree.evict(1) == [2]
    tree.check_integrity()


def test_session_end_stops_at_a_shared_prefix():
    tree, _ = make_tree()
    put(tree, [1, 2])
    put(tree, [1, 3], "session_end")  # node [1] has two children: not part of the tail
    put(tree, [7])
    assert tree.evict(2) == [3, 2]  # the dead tail, then the oldest seen-once leaf
    assert tree.evict(2) == [7, 1]  # [1] was hit by the second request: seen twice, last


def test_keep_protects_and_a_hit_clears_session_end():
    tree, _ = make_tree()
    put(tree, [1], "keep")
    put(tree, [2])
    assert tree.evict(1) == [2]  # keep: with the frequently used
    put(tree, [3], "session_end")
    put(tree, [4])
    hit(tree, [3])  # someone came back after all: the hint is gone, and [3] is seen twice
    assert tree.evict(1) == [4]


def test_hint_on_a_held_handle():
    tree, _ = make_tree()
    put(tree, [1, 2])
    put(tree, [3, 4])
    m = tree.match([3, 4])
    tree.lock(m.handle)
    tree.hint(m.handle, "session_end")  # as Release with a hint does, before unlocking
    tree.unlock(m.handle)
    assert tree.evict(2) == [4, 3]


def test_lru_and_lfu_ignore_hints():
    for policy in ("lru", "lfu"):
        tree, _ = make_tree(policy)
        put(tree, [1])
        put(tree, [2], "session_end")
        assert tree.evict(1) == [1]


def test_parse_hint():
    assert [parse_hint(h) for h in (None, "", "none", "session_end", "keep", 2)] == \
        [0, 0, 0, 1, 2, 2]
    with pytest.raises(InvalidArgument, match="unknown retention hint"):
        parse_hint("later")
    tree, _ = make_tree()
    with pytest.raises(InvalidArgument, match="unknown retention hint"):
        tree.insert([1], [1], "later")
    assert tree.num_cached_blocks == 0


def test_victims_compare_across_namespaces():
    factory = policy_factory("adaptive", capacity_blocks=2)  # p starts at 1
    ticks = iter(range(1, 10**6))
    a = RadixTree(1, factory("a"), clock=lambda: next(ticks))
    b = RadixTree(1, factory("b"), clock=lambda: next(ticks))
    put(a, [1, 2])
    hit(a, [1, 2])  # T2, older
    put(b, [1, 2])  # T1, newer; the same tokens, another namespace
    ka, kb = a.next_victim_key(), b.next_victim_key()
    assert ka is not None and kb is not None and kb < ka  # T1 over p goes first
    put(b, [3], "session_end")
    kd = b.next_victim_key()
    assert kd is not None and kd[0] == DEAD and kd < ka


def test_list_of_counts_hits_promotion_and_hints():
    tree, policy = make_tree()
    put(tree, [1])
    leaf = tree._root.children[toks(1)]
    assert policy.list_of(leaf) == ONCE
    assert policy.state.blocks == [0, 1, 0]
    hit(tree, [1])
    assert policy.list_of(leaf) == TWICE and policy.state.blocks == [0, 0, 1]


# ---- the service, several namespaces --------------------------------------------------------


def test_service_evicts_seen_once_across_namespaces():
    svc = make_service(policy="adaptive")
    try:
        from _kv import fill

        fill(svc, "a", toks(*range(8)))  # 2 blocks
        fill(svc, "a", toks(*range(8)))  # seen again: T2
        fill(svc, "b", toks(*range(100, 120)))  # 5 blocks, seen once, newer: T1 over p = 4
        r = svc.allocate("e", None, "c", 3)  # 1 free: 2 evicted, from b (LRU would take a's)
        ma = svc.match("e", "a", toks(*range(8)))
        mb = svc.match("e", "b", toks(*range(100, 120)))
        assert (ma.num_tokens, mb.num_tokens) == (8, 12)
        svc.check_integrity()
        svc.release("e", [r.lease_id, ma.lease_id, mb.lease_id])
        assert svc.stats().live_leases == 0
        svc.check_integrity()
    finally:
        svc.pool.close()


def test_service_hints_on_insert_and_release():
    svc = make_service(policy="adaptive")
    try:
        m = svc.match("e", "a", toks(*range(8)))
        ids = svc.allocate("e", m.lease_id, "a", 2).block_ids
        svc.insert("e", m.lease_id, "a", toks(*range(8)), ids, hint="session_end")
        svc.release("e", [m.lease_id])
        m = svc.match("e", "b", toks(*range(50, 58)))
        ids = svc.allocate("e", m.lease_id, "b", 2).block_ids
        svc.insert("e", m.lease_id, "b", toks(*range(50, 58)), ids)
        svc.release("e", [m.lease_id], hints=["session_end"])
        m = svc.match("e", "c", toks(*range(90, 98)))
        ids = svc.allocate("e", m.lease_id, "c", 2).block_ids
        svc.insert("e", m.lease_id, "c", toks(*range(90, 98)), ids)
        svc.release("e", [m.lease_id])
        with pytest.raises(InvalidArgument, match="2 retention hints for 1 items"):
            svc.release("e", [m.lease_id], hints=["keep", "keep"])
        r = svc.allocate("e", None, "d", 6)  # 2 free: the two hinted sessions go, c stays
        assert r.num_evicted == 4
        assert svc.match("e", "c", toks(*range(90, 98))).num_tokens == 8
        svc.check_integrity()
    finally:
        svc.pool.close()


@pytest.mark.parametrize("seed", range(4))
def test_service_integrity_with_adaptive_across_namespaces(seed):
    """Random requests (two- and four-call paths, random hints) into four namespaces on a
    16-block pool, leases kept open at random; the service's invariants after every step."""
    rng = random.Random(seed)
    svc = make_service(num_blocks=16, policy="adaptive")
    open_leases: list[int] = []
    try:
        for _ in range(300):
            ns = f"ns{rng.randrange(4)}"
            base = rng.randrange(3) * 100
            prompt = toks(*[base + t for t in range(4 * rng.randrange(1, 5) + rng.randrange(4))])
            hint = rng.choice([None, "session_end", "keep"])
            if rng.random() < 0.5:  # two round trips
                (m,) = svc.match_many("e", [(ns, prompt)], store_tokens=[1 << 20])
                ids = m.block_ids + m.new_block_ids
                full = min(len(ids), len(prompt) // 16)
                release = [m.lease_id] if rng.random() < 0.8 else []
                if full:
                    svc.insert_many(
                        "e", [InsertItem(m.lease_id, ns, prompt[: full * 16], ids[:full], hint)],
                        release=release)
                if not release or not full:
                    open_leases.append(m.lease_id)
            else:
                m = svc.match("e", ns, prompt)
                need = len(prompt) // 16 - len(m.block_ids)
                try:
                    new = svc.allocate("e", m.lease_id, ns, need).block_ids if need else ()
                    svc.insert("e", m.lease_id, ns, prompt, m.block_ids + new, hint)
                except Exception as e:  # no room while others are pinned
                    assert type(e).__name__ == "OutOfBlocks"
                open_leases.append(m.lease_id)
            while open_leases and (len(open_leases) > 3 or rng.random() < 0.5):
                lease = open_leases.pop(rng.randrange(len(open_leases)))
                svc.release("e", [lease], hints=[rng.choice([None, "session_end", "keep"])])
            svc.check_integrity()
        svc.release("e", open_leases)
        svc.check_integrity()
        assert svc.stats().pinned_blocks == 0
        assert svc.stats().evicted_blocks > 0
    finally:
        svc.pool.close()


# ---- hints derived from a trace -------------------------------------------------------------


def test_session_hints():
    keys = [["a", "b", "c"], ["a", "d"], ["a", "b", "c", "e"], [], ["a", "d"]]
    assert session_hints(keys) == [None, None, "session_end", None, "session_end"]
