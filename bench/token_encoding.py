"""Token ids on the wire: little-endian uint32 `bytes` vs packed `repeated uint32`.

    python bench/token_encoding.py [--json]

For 2k and 32k tokens, times what each side of a call pays: the client building and serializing
the message, the server parsing it and getting the ids into a numpy array (what the service
needs), and the wire size. The carrier messages are the protocol's own: MatchQuery.tokens
(bytes) and TreeNode.block_ids (packed repeated uint32).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from radixkv.v1 import radixkv_pb2 as pb

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import time_calls  # noqa: E402


def best_us(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    """Median of `repeat` timed calls, in microseconds (after one warm-up call)."""
    return float(np.median(time_calls(fn, repeat)) * 1e6)


def measure(n: int, repeat: int) -> dict[str, float]:
    ids = np.random.default_rng(0).integers(0, 128_000, n, dtype="<u4")
    as_list = ids.tolist()
    wire_bytes = pb.MatchQuery(namespace="ns", tokens=ids.tobytes()).SerializeToString()
    wire_packed = pb.TreeNode(block_ids=as_list).SerializeToString()

    def parse_bytes() -> np.ndarray:
        m = pb.MatchQuery.FromString(wire_bytes)
        return np.frombuffer(m.tokens, dtype="<u4")

    def parse_packed() -> np.ndarray:
        m = pb.TreeNode.FromString(wire_packed)
        return np.fromiter(m.block_ids, dtype="<u4", count=n)

    assert np.array_equal(parse_bytes(), parse_packed())
    return {
        "tokens": n,
        "bytes_wire": len(wire_bytes),
        "packed_wire": len(wire_packed),
        "bytes_build_us": best_us(lambda: pb.MatchQuery(
            namespace="ns", tokens=ids.tobytes()).SerializeToString(), repeat),
        "packed_build_us": best_us(lambda: pb.TreeNode(
            block_ids=as_list).SerializeToString(), repeat),
        "bytes_parse_us": best_us(parse_bytes, repeat),
        "packed_parse_us": best_us(parse_packed, repeat),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="2000,32000")
    p.add_argument("--repeat", type=int, default=200)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rows = [measure(int(n), args.repeat) for n in args.sizes.split(",")]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        print(f"{r['tokens']:>6} tokens | wire: bytes {r['bytes_wire']} B, packed "
              f"{r['packed_wire']} B | build+serialize: bytes {r['bytes_build_us']:.1f} us, "
              f"packed {r['packed_build_us']:.1f} us | parse to numpy: bytes "
              f"{r['bytes_parse_us']:.1f} us, packed {r['packed_parse_us']:.1f} us "
              f"({r['packed_parse_us'] / r['bytes_parse_us']:.0f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
