"""The table's bytes: a header page, then buckets of 128 bytes (two cache lines), each

    word 0        the bucket's sequence counter: odd while the writer changes the bucket
    words 1..7    up to 7 keys (a block's chained hash; 0: an empty way)
    words 8..14   their values: bits 0-31 block id + 1 (0: none, e.g. on disk only),
                  bits 32-39 tier (1: in the pool, 2: in the disk tier below it),
                  bits 40-63 the event sequence that wrote it (low 24 bits)
    word 15       unused

A key goes to bucket `key & (num_buckets - 1)`. One writer; readers take no lock: they read a
bucket's counter, its ways, the counter again, and use the bucket only if both counters are equal
and even (a seqlock), else read it again. The writer's stores and the readers' loads keep program
order on x86-64, which is what makes that enough; elsewhere the table is not published.
"""

from __future__ import annotations

import platform

MAGIC = 0x31425441564B5852  # "RXKVATB1" little-endian
VERSION = 1
HEADER_BYTES = 4096
WAYS = 7
BUCKET_WORDS = 16
BUCKET_BYTES = BUCKET_WORDS * 8

# header words
H_MAGIC, H_VERSION, H_STATE, H_BUCKETS, H_PID, H_SEQUENCE, H_BLOCK_SIZE, H_EPOCH = range(8)
# H_EPOCH and H_EPOCH + 1: the pool epoch's first 16 bytes (its uuid hex, as bytes)
LIVE, CLOSED = 1, 2

POOL, DISK = 1, 2
TIER_NAMES = {POOL: "pool", DISK: "disk"}


def supported() -> bool:
    """Whether this machine orders stores and loads as the read protocol needs (x86-64)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def num_buckets_for(entries: int) -> int:
    """Buckets for `entries` keys at most: a power of two, at most 2 keys a bucket on average
    (a bucket overflows, dropping a key to a miss, with probability about 1e-3)."""
    return 1 << max(6, (max(1, entries // 2) - 1).bit_length())


def table_bytes(num_buckets: int) -> int:
    return HEADER_BYTES + num_buckets * BUCKET_BYTES


def value(block_id: int | None, tier: int, sequence: int) -> int:
    return (0 if block_id is None else block_id + 1) | tier << 32 | (sequence & 0xFFFFFF) << 40


def epoch_words(epoch: str) -> tuple[int, int]:
    raw = epoch.encode()[:16].ljust(16, b"\0")
    return int.from_bytes(raw[:8], "little"), int.from_bytes(raw[8:], "little")
