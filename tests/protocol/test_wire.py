"""Match answers on the wire: what the servicer encodes, the client decodes to the same values."""

from __future__ import annotations

from radixkv.protocol.limits import HOLE
from radixkv.protocol.values import LeaseMatch, WindowLeaseMatch
from radixkv.protocol.wire import match_response_pb, match_results
from radixkv.v1 import radixkv_pb2 as pb


def round_trip(outcomes: list[LeaseMatch]) -> list[LeaseMatch]:
    resp = match_response_pb(outcomes, "ep")
    return match_results(pb.MatchResponse.FromString(resp.SerializeToString()))


def test_full_attention_answers_round_trip():
    outcomes = [LeaseMatch(1, 8, (3, 4), "ep"),
                LeaseMatch(2, 4, (3,), "ep", new_block_ids=(5, 6), num_evicted=1),
                LeaseMatch(3, 0, (), "ep", alloc_error="asked 3 blocks: 2 free")]
    assert round_trip(outcomes) == outcomes
    assert [type(o) for o in round_trip(outcomes)] == [LeaseMatch] * 3


def test_window_answers_carry_their_window_parts():
    outcomes: list[LeaseMatch] = [
        WindowLeaseMatch(1, 8, (3, 4), "ep", window_ids=(9,)),
        WindowLeaseMatch(2, 4, (3,), "ep", (5, 6), 2, window_ids=(9,),
                         new_window_ids=(HOLE, 10))]
    assert round_trip(outcomes) == outcomes
    r = match_response_pb(outcomes, "ep").results[1]
    assert (r.window_ids, len(r.new_window_ids)) == ((9).to_bytes(4, "little"), 8)


def test_a_window_answer_without_window_parts_is_a_plain_one_on_the_wire():
    """Empty window parts are the proto's defaults: the same bytes as a full-attention answer."""
    plain = match_response_pb([LeaseMatch(1, 4, (3,), "ep", (5,), 0)], "ep")
    window = match_response_pb([WindowLeaseMatch(1, 4, (3,), "ep", (5,), 0)], "ep")
    assert window.SerializeToString() == plain.SerializeToString()
