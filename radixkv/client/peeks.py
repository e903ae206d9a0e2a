"""A client's view of the service's lookup table: mapped once per pool epoch, re-mapped when the
service restarts, read with no call (radixkv/table/reader.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from radixkv.protocol.errors import StalePool, Unavailable
from radixkv.protocol.tokens import to_token_bytes
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
        data = to_token_bytes(tokens)
        return self.read(lambda r: r.peek(namespace, data))

    def keys(self, namespace: str, keys: Sequence[bytes]) -> Peek:
        return self.read(lambda r: r.peek_keys(namespace, keys))

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None

