"""The committed stubs are exactly what proto/gen.py makes from the .proto files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_fresh(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "proto" / "gen.py"), "--out", str(tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    generated = sorted(p.relative_to(tmp_path) for p in (tmp_path / "radixkv").rglob("*_pb2*"))
    assert generated, "gen.py produced nothing"
    committed = sorted(p.relative_to(REPO) for folder in ("v1", "etcd")
                       for p in (REPO / "radixkv" / folder).glob("*_pb2*"))
    assert generated == committed
    for rel in generated:
        assert (tmp_path / rel).read_bytes() == (REPO / rel).read_bytes(), (
            f"{rel} is stale: run `python proto/gen.py` and commit")
