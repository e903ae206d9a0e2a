"""Block hashes: the chained 64-bit hash of each block of a namespace's prompt (namespace salt ->
parent hash -> this block's content), the numbers KV events carry, routers and the cluster index
key prefixes by, and the lookup table (radixkv/table/) keys blocks by.

Two ways to the same numbers: `chain_hashes` (a block at a time, from any parent: the event log,
the routers) and `token_keys` / `path_keys` (a whole prompt in a fixed number of numpy passes:
engines reading the table). The chain h_i = h_(i-1) * P + c_i (mod 2**64) unrolls to
h_i = P**i * (h_0 + sum_(j<=i) c_j * P**-j): P is odd, so it has an inverse mod 2**64, and
numpy's uint64 arithmetic wraps mod 2**64, so a cumulative sum replaces the loop.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from radixkv.protocol.tokens import block_bytes

CHAIN_P = 0x9E3779B97F4A7C15  # the chain's multiplier (odd)
MASK64 = (1 << 64) - 1


@functools.cache
def position_keys(block_size: int) -> npt.NDArray[np.uint64]:
    """A fixed random odd 64-bit multiplier per position of a block (the same in every
    process: a seeded generator)."""
    keys = np.random.default_rng(0x7261646978).integers(0, 1 << 63, block_size, np.uint64)
    return keys * np.uint64(2) + np.uint64(1)


def namespace_salt(namespace: str) -> int:
    """A namespace's chain start (the hash "before" its first block)."""
    return int.from_bytes(hashlib.blake2b(namespace.encode(), digest_size=8).digest(), "little")


def block_contents(tokens: bytes, block_size: int) -> list[int]:
    """Each whole block's content hash, sum_k token_k * K_k mod 2**64 (K: position_keys), in
    one numpy pass over however many blocks."""
    n = len(tokens) // block_bytes(block_size)
    rows = np.frombuffer(tokens, "<u4", n * block_size).reshape(n, block_size)
    return (rows @ position_keys(block_size)).tolist()  # type: ignore[no-any-return]


def chain_from(h: int, contents: list[int]) -> list[int]:
    """h_i = h_(i-1) * P + c_i mod 2**64, from h_0 = h."""
    out = []
    for c in contents:
        h = (h * CHAIN_P + c) & MASK64
        out.append(h)
    return out


def chain_hashes(namespace: str, tokens: bytes | memoryview, block_size: int,
                 parent_hash: int | None = None) -> list[int]:
    """The chained 64-bit hash of each full block of `tokens` (little-endian uint32 bytes)
    following the block whose hash is `parent_hash` (None: at the root, the namespace's
    salt): the same numbers BlockStored events carry, so a router can hash a prompt and look
    its blocks up. Routing keys, not a digest: a collision costs a routing choice, never a
    wrong KV block (the tree matches tokens)."""
    h = namespace_salt(namespace) if parent_hash is None else parent_hash & MASK64
    return chain_from(h, block_contents(bytes(tokens), block_size))


Keys = npt.NDArray[np.uint64]


@functools.cache
def _powers(n: int) -> tuple[Keys, Keys]:
    """P**i and P**-i for i in 1..n, mod 2**64."""
    inverse = pow(CHAIN_P, -1, 1 << 64)
    up = [1] * (n + 1)
    down = [1] * (n + 1)
    for i in range(1, n + 1):
        up[i] = up[i - 1] * CHAIN_P & MASK64
        down[i] = down[i - 1] * inverse & MASK64
    return np.array(up[1:], np.uint64), np.array(down[1:], np.uint64)


@functools.cache
def _salt_u64(namespace: str) -> np.uint64:
    return np.uint64(namespace_salt(namespace))


def chain(salt: np.uint64, contents: Keys) -> Keys:
    """Each block's chained hash from `salt` (the namespace's: at the root), given each
    block's content hash."""
    n = len(contents)
    if n == 0:
        return np.empty(0, np.uint64)
    up, down = _powers(_bucket(n))
    acc = np.cumsum(contents * down[:n], dtype=np.uint64)  # (uint64 arrays wrap silently)
    return up[:n] * (acc + salt)


def _bucket(n: int) -> int:
    """Power-table sizes come in powers of two (few cached tables, each reused)."""
    return 1 << max(6, (n - 1).bit_length())


def token_keys(namespace: str, tokens: npt.NDArray[np.uint32], block_size: int) -> Keys:
    """The keys of the whole blocks of `tokens` (uint32) in token-keyed `namespace`."""
    n = len(tokens) // block_size
    rows = tokens[:n * block_size].reshape(n, block_size).astype(np.uint64)
    contents = rows @ position_keys(block_size)
    return chain(_salt_u64(namespace), contents)


def path_keys(namespace: str, keys: Sequence[bytes]) -> Keys:
    """The table keys of a key path (one engine key per block, all of one size, a multiple of
    4 bytes) in key-keyed `namespace`: each key hashed as a block of key_size / 4 uint32s."""
    if not keys:
        return np.empty(0, np.uint64)
    return token_keys(namespace, np.frombuffer(b"".join(keys), "<u4"), len(keys[0]) // 4)
