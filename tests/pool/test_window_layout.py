"""Sliding-window layouts (issue 14, item 1): the attention pattern from configs, presets and
flags; the byte math of full vs windowed layers; `radixkv calc`; PoolInfo carrying the window."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from _server import running_server

from kvpool.calc import calculate
from kvpool.layout import PRESETS, KVLayout
from kvpool.window import format_window_layers, parse_window_layers
from radixkv.client import Client, pool_info_from_pb
from radixkv.protocol.errors import InvalidArgument
from radixkv.protocol.wire import layout_pb
from radixkv.v1 import radixkv_pb2 as pb

BASE = {"num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "torch_dtype": "bfloat16"}


def hf(**extra: object) -> KVLayout:
    return KVLayout.from_hf_config({**BASE, **extra})


def small(**kw: object) -> KVLayout:
    """4 layers x 2 kv heads x head_dim 8, fp16, block 4: 64 B per layer per token."""
    args: dict[str, object] = dict(num_layers=4, num_kv_heads=2, head_dim=8, dtype="fp16",
                                   block_size=4)
    args.update(kw)
    return KVLayout(**args)  # type: ignore[arg-type]


# -- Hugging Face configs -------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, window, layers",
    [
        ({}, None, ()),  # Llama: no window
        ({"sliding_window": None}, None, ()),  # Mistral v0.2+: null is full attention
        ({"sliding_window": 4096}, 4096, (0, 1, 2, 3, 4, 5)),  # Mistral-7B-v0.1: every layer
        ({"sliding_window": 4096, "model_type": "gemma2"}, 4096, (0, 2, 4)),  # Gemma-2
        ({"sliding_window": 1024, "sliding_window_pattern": 3}, 1024, (0, 1, 3, 4)),  # Gemma-3
        ({"sliding_window": 1024, "_sliding_window_pattern": 6}, 1024, (0, 1, 2, 3, 4)),
        ({"sliding_window": 4096, "sliding_window_pattern": 1}, None, ()),  # all full
        ({"sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 3},
         128, (0, 2, 4)),  # gpt-oss
        ({"sliding_window": 512, "sliding_window_pattern": 6,  # layer_types wins
          "layer_types": ["full_attention"] * 5 + ["sliding_attention"]}, 512, (5,)),
        ({"sliding_window": 4096, "layer_types": ["full_attention"] * 6}, None, ()),
        ({"sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 2},
         None, ()),  # Qwen2 as shipped
        ({"sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 4},
         4096, (4, 5)),  # Qwen2 with its window on
    ],
)
def test_hf_config_attention_patterns(extra, window, layers):
    lay = hf(**extra)
    assert (lay.sliding_window, lay.window_layers) == (window, layers)
    assert lay.bytes_per_token == 2 * 6 * 2 * 8 * 2  # the geometry is unchanged


def test_hf_multimodal_config_reads_the_text_config():
    cfg = {"model_type": "gemma3", "text_config": {**BASE, "num_hidden_layers": 12,
                                                   "sliding_window": 1024,
                                                   "sliding_window_pattern": 6}}
    lay = KVLayout.from_hf_config(cfg)
    assert (lay.sliding_window, lay.window_pattern) == (1024, "5:1")
    assert lay.full_layers == (5, 11)


def test_hf_transformers_configs():
    transformers = pytest.importorskip("transformers")
    cases = {"MistralConfig": (4096, "all"), "Gemma2Config": (4096, "alternate"),
             "Gemma3TextConfig": (4096, "5:1"), "GptOssConfig": (128, "alternate"),
             "Qwen2Config": (None, ""), "LlamaConfig": (None, "")}
    for name, (window, pattern) in cases.items():
        lay = KVLayout.from_hf_config(getattr(transformers, name)().to_dict())
        assert (lay.sliding_window, lay.window_pattern) == (window, pattern), name


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"sliding_window": 0}, "sliding_window must be a positive number of tokens, got 0"),
        ({"sliding_window": -4}, "must be a positive number of tokens, got -4"),
        ({"sliding_window": "4k"}, "must be a positive number of tokens"),
        ({"sliding_window": 8, "layer_types": ["sliding_attention"] * 5}, "must list 6"),
        ({"sliding_window": 8, "layer_types": ["chunked_attention"] * 6},
         "chunked_attention: only sliding_attention and full_attention"),
        ({"sliding_window": None, "layer_types": ["sliding_attention"] * 6},
         "sliding_window is null"),
        ({"sliding_window": 8, "sliding_window_pattern": 0}, "sliding_window_pattern"),
        ({"sliding_window": 8, "use_sliding_window": True, "max_window_layers": -1},
         "max_window_layers"),
    ],
)
def test_hf_config_bad_windows(extra, message):
    with pytest.raises(InvalidArgument, match=message):
        hf(**extra)


# -- layer pattern specs and the dataclass --------------------------------------------------


@pytest.mark.parametrize(
    "spec, layers",
    [
        ("all", (0, 1, 2, 3, 4, 5)),
        ("alternate", (0, 2, 4)),
        ("1:1", (0, 2, 4)),
        ("5:1", (0, 1, 2, 3, 4)),
        ("2:1", (0, 1, 3, 4)),
        ("1:0", (0, 1, 2, 3, 4, 5)),
        ("0-2, 5", (0, 1, 2, 5)),
        ("4,1,1", (1, 4)),
    ],
)
def test_window_layer_specs(spec, layers):
    assert parse_window_layers(spec, 6) == layers
    assert parse_window_layers(format_window_layers(layers, 6), 6) == layers


def test_format_picks_the_shortest_spec():
    assert format_window_layers(tuple(range(48)), 48) == "all"
    assert format_window_layers(tuple(range(0, 24, 2)), 24) == "alternate"
    assert format_window_layers(tuple(i for i in range(48) if i % 6 < 5), 48) == "5:1"
    assert format_window_layers((0, 1, 2, 5), 6) == "0-2,5"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("0:3", "names no layer of 6"),
        ("0:0", "N \\+ M > 0"),
        ("6", "not within layers 0-5"),
        ("3-1", "not within layers 0-5"),
        ("", "cannot read"),
        ("every other", "cannot read"),
    ],
)
def test_bad_window_layer_specs(spec, message):
    with pytest.raises(InvalidArgument, match=message):
        parse_window_layers(spec, 6)


def test_layout_window_validation():
    with pytest.raises(InvalidArgument, match="positive number of tokens, got 0"):
        small(sliding_window=0, window_layers=(0,))
    with pytest.raises(InvalidArgument, match="positive number of tokens, got -1"):
        small().with_window(-1)
    with pytest.raises(InvalidArgument, match="without a sliding_window"):
        small(window_layers=(0,))
    with pytest.raises(InvalidArgument, match="non-empty tuple"):
        small(sliding_window=8)
    with pytest.raises(InvalidArgument, match="non-empty tuple"):
        small(sliding_window=8, window_layers=[0, 1])
    with pytest.raises(InvalidArgument, match="not one of the layers 0-3"):
        small(sliding_window=8, window_layers=(0, 4))
    with pytest.raises(InvalidArgument, match="increasing and distinct"):
        small(sliding_window=8, window_layers=(2, 1))
    with pytest.raises(InvalidArgument, match="names no layer"):
        small().with_window(8, "0:1")


def test_no_window_is_unchanged():
    lay = small()
    assert not lay.is_windowed and lay.window_pattern == "" and lay.window_blocks == 0
    assert lay.full_layers == (0, 1, 2, 3)
    assert set(lay.to_dict()) == {"num_layers", "num_kv_heads", "head_dim", "dtype",
                                  "block_size", "model_dtype", "group_size", "key_scales",
                                  "sink_tokens"}
    assert "window" not in repr(lay)
    assert lay.full_bytes_per_token == lay.bytes_per_token and lay.window_bytes_per_token == 0
    assert lay.conversation_bytes(10) == lay.conversation_bytes(10, windowed=False) == 3 * 1024
    assert "window_rows" not in calculate(lay, dtypes=()).to_dict()


def test_window_round_trips_through_dict_and_with_window():
    lay = small().with_window(6, "alternate")
    assert lay.window_layers == (0, 2) and lay.full_layers == (1, 3)
    data = json.loads(json.dumps(lay.to_dict()))
    assert data["window_layers"] == [0, 2]
    assert KVLayout.from_dict(data) == lay
    assert "sliding_window=6, window_layers='alternate'" in repr(lay)
    assert lay.with_window(None) == small()
    assert lay.with_window(6, [2, 0, 2]) == lay
    assert lay.with_dtype("int8", 0).window_layers == (0, 2)  # a dtype change keeps the window


# -- byte math ------------------------------------------------------------------------------


def test_byte_math_by_hand():
    lay = small().with_window(6, "alternate")  # 2 full + 2 windowed layers, 64 B/layer/token
    assert lay.layer_bytes_per_block == 64 * 4
    assert (lay.full_bytes_per_token, lay.window_bytes_per_token) == (128, 128)
    assert lay.full_bytes_per_block + lay.window_bytes_per_block == lay.bytes_per_block == 1024
    assert lay.window_blocks == 2  # ceil((6 - 1) / 4)
    # 20 tokens: 5 blocks; full layers keep 5, windowed layers the last 2
    assert lay.conversation_blocks(20) == 5
    assert lay.conversation_bytes(20) == 5 * 4 * 128 + 2 * 4 * 128 == 3584
    assert lay.conversation_bytes(20, windowed=False) == 20 * 256 == 5120
    # shorter than the window: nothing to drop; 0 tokens cost nothing
    assert lay.conversation_bytes(6) == lay.conversation_bytes(6, windowed=False) == 2048
    assert lay.conversation_bytes(0) == 0
    # W = 1: a query sees only itself, so windowed layers keep no block
    one = small().with_window(1, "all")
    assert one.window_blocks == 0 and one.conversation_bytes(20) == 0
    with pytest.raises(InvalidArgument, match="num_tokens"):
        lay.conversation_bytes(-1)


def test_byte_math_quantized_with_sinks():
    lay = small(dtype="int8", sink_tokens=2).with_window(5, "1:3")  # layer 0 windowed
    layer_block = lay.bytes_per_block // 4
    layer_sinks = lay.sink_bytes // 4  # 2 tokens x 2 (K, V) x 2 heads x 8 x 2 B (bf16)
    assert layer_sinks == 128 and lay.layer_bytes_per_block == layer_block
    assert lay.window_blocks == 1
    # 3 blocks: 3 full layers keep 3 blocks and their sinks, the window layer 1 block, no sinks
    assert lay.conversation_bytes(12) == 3 * 3 * layer_block + 3 * layer_sinks + layer_block
    assert lay.conversation_bytes(12, windowed=False) == 3 * lay.bytes_per_block + lay.sink_bytes
    # one block: the window still reaches block 0, so it keeps the sinks too
    assert lay.conversation_bytes(4) == lay.conversation_bytes(4, windowed=False)


@pytest.mark.parametrize(
    "preset, layers, full_bpt, window_bpt, window_blocks, windowed, all_full",
    [
        # 32 layers x 8 x 128 x bf16, window 4,096: a 32,768-token conversation (2,048 blocks)
        # keeps 256 blocks of every layer
        ("mistral-7b-v0.1", 32, 0, 131072, 256, 256 * 16 * 131072, 32768 * 131072),
        # 48 layers x 8 x 256, 8 full (65,536 B/token) and 40 windowed (327,680), window 1,024
        ("gemma-3-like", 48, 65536, 327680, 64, 2048 * 16 * 65536 + 64 * 16 * 327680,
         32768 * 393216),
        # 24 layers x 8 x 64, 12 and 12 (24,576 B/token each), window 128
        ("gpt-oss-like", 24, 24576, 24576, 8, 2048 * 16 * 24576 + 8 * 16 * 24576,
         32768 * 49152),
    ],
)
def test_windowed_presets(preset, layers, full_bpt, window_bpt, window_blocks, windowed,
                          all_full):
    lay = KVLayout.from_preset(preset)
    assert lay.num_layers == layers and lay.dtype == "bf16"
    assert (lay.full_bytes_per_token, lay.window_bytes_per_token) == (full_bpt, window_bpt)
    assert lay.window_blocks == window_blocks
    assert lay.conversation_bytes(32768) == windowed
    assert lay.conversation_bytes(32768, windowed=False) == all_full
    assert PRESETS["mistral-7b"].sliding_window is None  # v0.2 and later


# -- radixkv calc -----------------------------------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "radixkv", *args],
                          capture_output=True, text=True, env={"COLUMNS": "160", "PATH": ""})


def test_calc_report_window_rows():
    report = calculate(KVLayout.from_preset("gemma-3-like"), memory_bytes=80 * 2**30)
    assert [w.dtype for w in report.window_rows] == ["bf16", "int8", "int4"]
    bf16 = report.window_rows[0]
    assert bf16.conversation_bytes_windowed == 256 * 16 * 65536 + 64 * 16 * 327680
    assert bf16.conversation_bytes_all_full == 4096 * 393216 == report.rows[0].context_bytes
    assert bf16.ratio == round(1610612736 / 603979776, 4) == 2.6667
    assert bf16.conversations_in_memory_windowed == 80 * 2**30 // 603979776 == 142
    assert bf16.conversations_in_memory_all_full == report.rows[0].requests_in_memory == 53


def test_calc_cli_windowed_json_and_table():
    out = run_cli("calc", "--preset", "gpt-oss-like", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["layout"]["sliding_window"] == 128
    assert data["layout"]["window_layers"] == list(range(0, 24, 2))
    assert (data["window_pattern"], data["num_window_layers"], data["num_full_layers"]) == (
        "alternate", 12, 12)
    assert (data["full_bytes_per_token"], data["window_bytes_per_token"]) == (24576, 24576)
    assert data["conversation_bytes_windowed"] == 103_809_024  # 256 x 16 x 24,576 + 8 x 16 x ..
    assert data["conversation_bytes_all_full"] == 201_326_592
    assert data["window_ratio"] == 1.9394
    assert [r["dtype"] for r in data["window_rows"]] == ["bf16", "int8", "int4"]
    table = run_cli("calc", "--preset", "gpt-oss-like", "--memory", "80GiB")
    assert table.returncode == 0, table.stderr
    for text in ("sliding window 128 on 12 of 24", "(alternate)",
                 "bytes / token, 12 full layers", "bytes / token, 12 windowed layers",
                 "4,096-token conversation, windowed", "103.81 MB",
                 "4,096-token conversation, all layers full", "201.33 MB", "1.94x",
                 "last 8 of 256", "conversations in budget, windowed"):
        assert text in table.stdout, text


def test_calc_cli_full_attention_has_no_window_output():
    data = json.loads(run_cli("calc", "--preset", "llama-3-8b", "--json").stdout)
    assert "window_rows" not in data and "sliding_window" not in data["layout"]
    table = run_cli("calc", "--preset", "llama-3-8b").stdout
    assert "windowed" not in table and "sliding" not in table


def test_calc_cli_window_flags():
    data = json.loads(run_cli("calc", "--preset", "llama-3-8b", "--sliding-window", "1024",
                              "--window-layers", "3:1", "--json").stdout)
    assert data["sliding_window"] == 1024 and data["num_window_layers"] == 24
    assert data["layout"]["window_layers"][:4] == [0, 1, 2, 4]
    data = json.loads(run_cli("calc", "--preset", "llama-3-8b", "--sliding-window", "4096",
                              "--json").stdout)
    assert data["window_pattern"] == "all"  # the default pattern
    # a windowed preset: a new W keeps its pattern, a new pattern keeps its W
    data = json.loads(run_cli("calc", "--preset", "gemma-3-like", "--sliding-window", "512",
                              "--json").stdout)
    assert (data["sliding_window"], data["window_pattern"]) == (512, "5:1")
    data = json.loads(run_cli("calc", "--preset", "gemma-3-like", "--window-layers", "all",
                              "--json").stdout)
    assert (data["sliding_window"], data["window_pattern"]) == (1024, "all")


def test_calc_cli_window_from_model_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {**BASE, "model_type": "gemma2", "sliding_window": 64}))
    data = json.loads(run_cli("calc", "--model-config", str(tmp_path), "--json").stdout)
    assert (data["sliding_window"], data["window_pattern"]) == (64, "alternate")


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--sliding-window", "0"), "must be a positive integer, got 0"),
        (("--sliding-window", "-8"), "must be a positive integer"),
        (("--window-layers", "all"), "needs --sliding-window W"),
        (("--sliding-window", "8", "--window-layers", "0:2"), "names no layer of 32"),
        (("--sliding-window", "8", "--window-layers", "40"), "not within layers 0-31"),
    ],
)
def test_calc_cli_bad_window_flags(flags, message):
    out = run_cli("calc", "--preset", "llama-3-8b", *flags)
    assert out.returncode == 2, out.stdout
    assert message in out.stderr


# -- PoolInfo carries the window ------------------------------------------------------------


def pool_info(layout: KVLayout) -> pb.PoolInfoResponse:
    return pb.PoolInfoResponse(layout=layout_pb(layout), backend="host", num_blocks=4,
                               epoch="e", shm_name="/x", nbytes=4 * layout.bytes_per_block)


def test_pool_info_round_trips_the_window():
    for lay in (small(), small().with_window(6, "alternate"),
                small(dtype="int4", sink_tokens=2).with_window(9, "0,3")):
        assert pool_info_from_pb(pool_info(lay)).layout == lay
    assert not layout_pb(small()).window_layers  # full attention: nothing more on the wire
    bad = pool_info(small())
    bad.layout.sliding_window, bad.layout.window_layers[:] = 6, [7]
    with pytest.raises(InvalidArgument, match="does not understand the service's pool layout"):
        pool_info_from_pb(bad)


def test_serve_with_a_window_reports_it():
    with running_server("--sliding-window", "6", "--window-layers", "alternate") as server, \
            Client(server.socket) as kv:
        layout = kv.pool_info().layout
        assert (layout.sliding_window, layout.window_layers) == (6, (0,))
        assert layout.bytes_per_block == 1024  # the whole block: a full part and a window part
