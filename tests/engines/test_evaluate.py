"""The accuracy harness: fp32 KV written into the pool by one process and read by another gives
the perplexity of the model computing everything itself (a short context here; the bench runs
512 / 2,048 / 8,192)."""

from __future__ import annotations

import tempfile
from typing import Any

import pytest

from radixkv.engines import evaluate
from radixkv.protocol.errors import InvalidArgument


@pytest.mark.parametrize("context, fraction, expected", [
    (512, 0.5, 256), (256, 0.3, 64), (40, 0.5, 16), (32, 1.0, 16), (16, 0.5, 0),
])
def test_the_cached_part_is_whole_blocks_and_leaves_a_token(context: int, fraction: float,
                                                            expected: int) -> None:
    assert evaluate.cached_length(context, 16, fraction) == expected


def test_windows_are_consecutive_slices() -> None:
    assert evaluate.corpus_windows(list(range(10)), 4, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(InvalidArgument, match="3 windows of 4 tokens need 12 tokens"):
        evaluate.corpus_windows(list(range(10)), 4, 3)
    assert [evaluate.default_windows(c) for c in (512, 2048, 8192)] == [16, 4, 1]


def test_an_unknown_kv_format_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="kv format 'int3' is not one of fp32, int8"):
        evaluate.check_kv_dtype("int3")


def test_fp32_kv_through_the_pool_keeps_the_perplexity(smollm2: Any) -> None:
    from _server import running_server

    with tempfile.TemporaryDirectory(prefix="rkv-acc-") as directory, running_server(
            *smollm2.serve_flags(directory), num_blocks=24, block_size=16) as srv:
        rows = evaluate.run_accuracy(srv.socket, smollm2, "fp32", [256], windows=2)
    [row] = rows
    assert (row.kv_dtype, row.context, row.windows) == ("fp32", 256, 2)
    assert (row.cached_tokens, row.scored_tokens) == (128, 2 * 127)
    assert 2 < row.ppl_reference < 100  # English prose, a real model
    assert abs(row.delta_ppl_pct) < 1e-3  # measured 0 to 6e-5 %
    assert row.max_abs_logit_diff < 1e-3  # measured ~6e-5
