"""Limits and sentinels both sides of the wire agree on; imports nothing of radixkv, so an engine
reads them without loading the service."""

from __future__ import annotations

MIN_KEY_SIZE = 8  # bytes per block key of a key-keyed namespace (a multiple of 4)
MAX_KEY_SIZE = 64
MIN_LEASE_TTL_S = 1.0  # the shortest TTL a call may ask for (unless the default is shorter)
HOLE = 0xFFFFFFFF  # a block without its window part
