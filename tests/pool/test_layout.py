from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvpool.calc import calculate
from kvpool.layout import PRESETS, KVLayout, format_bytes, parse_bytes
from radixkv.protocol.errors import InvalidArgument


def make_layout(**kw: object) -> KVLayout:
    args: dict[str, object] = dict(num_layers=2, num_kv_heads=2, head_dim=8, dtype="fp16",
                                   block_size=4)
    args.update(kw)
    return KVLayout(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "preset, layers, kv_heads, head_dim, bytes_per_token",
    [
        ("llama-3-8b", 32, 8, 128, 131072),
        ("llama-3-70b", 80, 8, 128, 327680),
        ("llama-3.1-405b", 126, 8, 128, 516096),
        ("mistral-7b", 32, 8, 128, 131072),
        ("qwen2.5-7b", 28, 4, 128, 57344),
        ("qwen2.5-72b", 80, 8, 128, 327680),
    ],
)
def test_presets_follow_the_formula(preset, layers, kv_heads, head_dim, bytes_per_token):
    lay = PRESETS[preset]
    assert (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.dtype) == (
        layers, kv_heads, head_dim, "bf16")
    assert lay.bytes_per_token == 2 * layers * kv_heads * head_dim * 2 == bytes_per_token


def test_reference_figures_llama3_70b():
    lay = KVLayout.from_preset("llama-3-70b")
    assert lay.bytes_per_token == 327_680
    assert lay.context_bytes(4096) == 1_342_177_280  # 1.34 GB, 1.25 GiB
    assert format_bytes(lay.context_bytes(4096)) == "1.34 GB (1.25 GiB)"
    assert format_bytes(100 * lay.context_bytes(4096)) == "134.22 GB (125.00 GiB)"
    assert lay.bytes_per_block == 327_680 * 16


def test_quantized_sizes_count_scales():
    lay = make_layout(dtype="int8", head_dim=128)  # 2 layers, 2 kv heads, block 4, bf16 model
    # values: 2 (K, V) x 2 layers x 2 heads x 128 bytes; scales: one fp16 per (K|V, layer, head)
    assert lay.data_bytes_per_token == 1024
    assert lay.scale_bytes_per_token == 2 * 2 * 2 * 2
    assert lay.bytes_per_block == 4 * (1024 + 16)
    int4 = lay.with_dtype("int4", sink_tokens=0)
    assert int4.data_bytes_per_token == 512
    # keys per channel over the block: scale + zero per (layer, head, channel), fp16
    # values per token per head: scale + zero per (layer, token, head), fp16
    key_scales = 2 * 2 * 128 * 2 * 2
    value_scales = 2 * 4 * 2 * 2 * 2
    assert int4.bytes_per_block == 4 * 512 + key_scales + value_scales
    grouped = make_layout(dtype="int4", head_dim=128, group_size=32, key_scales="token")
    assert grouped.bytes_per_block == 4 * 512 + 2 * (2 * 4 * 2 * 4 * 2 * 2)
    # sink tokens: once per sequence, in the model dtype
    sinks = lay.with_dtype("int4", sink_tokens=2)
    assert sinks.sink_bytes == 2 * 2 * 2 * 2 * 128 * 2
    assert sinks.sink_bytes_per_block == sinks.bytes_per_block + sinks.sink_bytes
    assert sinks.context_bytes(10) == -(-10 * sinks.bytes_per_block // 4) + sinks.sink_bytes


def test_quantized_layout_bad_input():
    with pytest.raises(InvalidArgument, match="group size 48 does not divide head_dim 64"):
        make_layout(dtype="int4", head_dim=64, group_size=48)
    with pytest.raises(InvalidArgument, match="sink tokens .4. must be fewer than the block size"):
        make_layout(dtype="int8", sink_tokens=4)
    with pytest.raises(InvalidArgument, match="not quantized"):
        make_layout(dtype="bf16", sink_tokens=1)
    with pytest.raises(InvalidArgument, match="key_scales"):
        make_layout(dtype="int4", key_scales="row")


def test_tokens_in_budget_counts_whole_blocks():
    lay = make_layout()  # 2*2*2*8*2 = 128 B/token, 512 B/block
    assert lay.bytes_per_block == 512
    assert lay.tokens_in(1023) == 4
    assert lay.tokens_in(1024) == 8


def test_from_hf_config_variants(tmp_path):
    cfg = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
           "hidden_size": 256, "torch_dtype": "float16"}
    lay = KVLayout.from_hf_config(cfg)
    assert (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.dtype) == (4, 2, 32, "fp16")
    lay = KVLayout.from_hf_config({**cfg, "head_dim": 64})
    assert lay.head_dim == 64
    no_gqa = {k: v for k, v in cfg.items() if k != "num_key_value_heads"}
    assert KVLayout.from_hf_config(no_gqa).num_kv_heads == 8
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert KVLayout.from_hf_config(tmp_path) == KVLayout.from_hf_config(cfg)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_hidden_layers": None}, "no 'num_hidden_layers'"),
        ({"num_attention_heads": 0}, "'num_attention_heads' must be a positive integer"),
        ({"hidden_size": 250}, "not divisible"),
        ({"num_key_value_heads": 3}, "not a multiple"),
    ],
)
def test_from_hf_config_errors_name_the_field(change, message):
    cfg = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
           "hidden_size": 256}
    for key, value in change.items():
        if value is None:
            del cfg[key]
        else:
            cfg[key] = value
    with pytest.raises(InvalidArgument, match=message):
        KVLayout.from_hf_config(cfg)


def test_bad_layouts_and_sizes():
    with pytest.raises(InvalidArgument, match="block_size"):
        make_layout(block_size=0)
    with pytest.raises(InvalidArgument, match="dtype"):
        make_layout(dtype="fp64")
    with pytest.raises(InvalidArgument, match="unknown preset"):
        KVLayout.from_preset("gpt-9")
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("1.5GB") == 1_500_000_000
    with pytest.raises(InvalidArgument, match="as a size"):
        parse_bytes("lots")


def test_calculate_rows():
    report = calculate(KVLayout.from_preset("llama-3-8b"), memory_bytes=80 * 2**30)
    assert [r.dtype for r in report.rows] == ["bf16", "int8", "int4"]
    assert report.rows[0].tokens_in_memory == 80 * 2**30 // (131072 * 16) * 16


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "radixkv", *args],
                          capture_output=True, text=True, env={"COLUMNS": "160", "PATH": ""})


def test_calc_cli_json_and_table():
    out = run_cli("calc", "--preset", "llama-3-70b", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["bytes_per_token"] == 327680
    assert data["context_bytes"] == 1_342_177_280
    table = run_cli("calc", "--preset", "llama-3-70b")
    assert table.returncode == 0
    assert "327,680" in table.stdout
    assert "1.34 GB" in table.stdout and "(1.25 GiB)" in table.stdout
    assert "134.22 GB" in table.stdout and "(125.00 GiB)" in table.stdout


def test_calc_cli_bad_config_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    out = run_cli("calc", "--model-config", str(tmp_path))
    assert out.returncode == 2
    assert "no 'num_hidden_layers'" in out.stderr
