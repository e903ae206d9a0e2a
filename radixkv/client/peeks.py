"""A client's view of the service's lookup table: mapped once per pool epoch, re-mapped when the
service restarts, read with no call (radixkv/table/reader.py)."""

from __future__ import annotations

import array
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from radixkv.protocol.errors import InvalidArgument, StalePool, Unavailable
from radixkv.protocol.values import PoolInfo
from radixkv.table.reader import Peek, TableReader


class Peeks:
    """`info()` gives the service's PoolInfo as the client last fetched it; `refresh()` fetches
    it again (one call), after the table went stale."""

    def __init__(self, info: Callable[[], PoolInfo], refresh: Callable[[], PoolInfo]) -> None:
        self._info = info
        self._refresh = refresh
        self.reader: TableReader | None = None

    def _reader(self, refresh: bool) -> TableReader:
        if self.reader is not None and not refresh:
            return self.reader
        self.close()
        info = self._refresh() if refresh else self._info()
        if not info.table_name:
            raise Unavailable("this radixkv publishes no lookup table (started with "
                              "--no-lookup-table, or a windowed pool); ask with a Match")
        self.reader = TableReader(info.table_name, info.table_nbytes, info.epoch)
        return self.reader

    def read(self, fn: Callable[[TableReader], Peek]) -> Peek:
        """`fn(reader)`, once more on a fresh mapping if the table went stale (a restart)."""
        try:
            return fn(self._reader(False))
        except StalePool:
            return fn(self._reader(True))

    def tokens(self, namespace: str, tokens: Any) -> Peek:
        return self.read(lambda r: r.peek(namespace, token_array(tokens)))

    def keys(self, namespace: str, keys: Sequence[bytes]) -> Peek:
        return self.read(lambda r: r.peek_keys(namespace, keys))

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None


def token_array(tokens: Any) -> np.ndarray[Any, np.dtype[np.uint32]]:
    """Tokens (a uint32 array, little-endian bytes, or a sequence of ints) as a uint32 array."""
    if isinstance(tokens, np.ndarray):
        if tokens.dtype != np.uint32:
            if tokens.size and (tokens.min() < 0 or tokens.max() > 0xFFFFFFFF):
                raise InvalidArgument("token ids must be within 0..2**32-1")
        return np.asarray(tokens, np.uint32)
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        if len(tokens) % 4:
            raise InvalidArgument(f"token bytes must be whole uint32s, got {len(tokens)} bytes")
        return np.frombuffer(tokens, "<u4")
    try:
        return np.frombuffer(array.array("I", tokens), np.uint32)
    except (OverflowError, TypeError) as e:
        raise InvalidArgument(f"token ids must be ints within 0..2**32-1: {e}") from None
