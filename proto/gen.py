"""Regenerate the committed Python stubs from proto/radixkv/v1/*.proto.

    .venv/bin/python proto/gen.py            # writes radixkv/v1/*_pb2*.py(i)
    .venv/bin/python proto/gen.py --out DIR  # writes elsewhere (the freshness test uses this)

The proto tree mirrors the package, so `radixkv/v1/radixkv.proto` becomes the module
`radixkv.v1.radixkv_pb2`. grpcio-tools is pinned in the `dev` extra so output is reproducible.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
REPO = PROTO_ROOT.parent


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc

    protos = sorted(PROTO_ROOT.glob("radixkv/**/*.proto"))
    for proto in protos:
        rel = proto.relative_to(PROTO_ROOT)
        rc = protoc.main([
            "grpc_tools.protoc", f"-I{PROTO_ROOT}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}", str(rel),
        ])
        if rc != 0:
            raise SystemExit(f"protoc failed on {rel} (exit {rc})")
    return sorted(p for p in (out / "radixkv").rglob("*_pb2*") if p.suffix in (".py", ".pyi"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO, help="output root (default: repo)")
    args = parser.parse_args()
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
