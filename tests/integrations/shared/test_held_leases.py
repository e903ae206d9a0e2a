"""radixkv.integrations.held: the leases an SGLang backend's batch_exists keeps for the
batch_get_v1 after it, against a plain reference: every lease kept comes back exactly once
(to the get that takes it, or to be released), a get takes only a lease whose path begins
with its own (same prefix) and only in the first half of its TTL."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.integrations.held import HeldLeases
from radixkv.protocol.values import LeaseMatch

HOLD_S = 2.0
LIMIT = 4
KEYS = [bytes([k]) * 8 for k in range(3)]  # a small alphabet: paths share prefixes often

paths = st.lists(st.sampled_from(KEYS), min_size=1, max_size=4)
ops = st.lists(st.one_of(
    st.tuples(st.just("hold"), paths, st.integers(0, 2)),
    st.tuples(st.just("take"), paths, st.integers(0, 2)),
    st.tuples(st.just("wait"), st.floats(0.0, 1.5), st.just(0)),
    st.tuples(st.just("drain"), st.just([]), st.just(0))), max_size=40)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_every_kept_lease_comes_back_once(steps: list[tuple[str, object, int]]) -> None:
    now = [0.0]
    held = HeldLeases(HOLD_S, limit=LIMIT, clock=lambda: now[0])
    kept: dict[int, tuple[tuple[bytes, ...], int, float]] = {}  # reference: id -> path, skip, at
    returned: list[int] = []
    next_id = 1
    for op, arg, skip in steps:
        if op == "wait":
            assert isinstance(arg, float)
            now[0] += arg
            continue
        if op == "drain":
            out = [m.lease_id for m in held.drain()]
            assert sorted(out) == sorted(kept)
            returned += out
            kept.clear()
            continue
        assert isinstance(arg, list)
        path, skip = tuple(arg), min(skip, len(arg) - 1)
        if op == "hold":
            m = LeaseMatch(next_id, 0, (), "e")
            kept[next_id] = (path, skip, now[0])
            next_id += 1
            stale = [s.lease_id for s in held.hold(path, skip, m, now[0], HOLD_S)]
        else:
            taken, stale_m = held.take(path, skip)
            stale = [s.lease_id for s in stale_m]
            if taken is not None:
                assert taken.at == kept[taken.match.lease_id][2] and taken.ttl == HOLD_S
                k_path, k_skip, at = kept.pop(taken.match.lease_id)
                assert k_skip == skip and k_path[:len(path)] == path
                assert now[0] - at < HOLD_S / 2
                returned.append(taken.match.lease_id)
        for lease_id in stale:
            assert lease_id in kept
            kept.pop(lease_id)
        returned += stale
        # what is still kept: the newest LIMIT within half the TTL, and none of them usable
        # was passed over by a take of its path
        assert len(held) == len(kept) <= LIMIT
        assert all(now[0] - at < HOLD_S / 2 for _, _, at in kept.values())
        if op == "take" and taken is None:
            assert not any(s == skip and p[:len(path)] == path for p, s, _ in kept.values())
    returned += [m.lease_id for m in held.drain()]
    assert sorted(returned) == list(range(1, next_id))  # each exactly once
