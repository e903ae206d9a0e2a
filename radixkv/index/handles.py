"""What a caller asks of a match handle once it holds one: pin the last insert's path, whether
one path holds another, a path's nodes and lock count, a retention hint. A part of RadixTree
(radixkv/index/tree.py), which holds the state."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from radixkv.index.hints import NO_HINT, SESSION_END, parse_hint
from radixkv.index.node import Handle, Node
from radixkv.protocol.errors import InvalidArgument


class HandleCalls:
    """RadixTree's calls on match handles (the tree's state, as RadixTree.__init__ sets it)."""

    _root: Node
    _version: int
    _inserted: tuple[Node, int]
    _policy: Any
    lock: Callable[..., None]

    def lock_inserted(self) -> object | None:
        """Pin the last insert()'s path as lock(hit=False) of a fresh match would, without a
        walk: the handle to unlock (None: nothing inserted); InvalidArgument if changed since."""
        node, version = self._inserted
        if version != self._version:
            raise InvalidArgument("lock_inserted() after another mutation than the insert")
        if node is self._root:
            return None
        handle = Handle(self, node, len(node.block_ids), version)
        self.lock(handle, hit=False)
        return handle

    def covers(self, handle: object, other: object) -> bool:
        """Whether `handle`'s path holds all of `other`'s: other's end node is on it (locked
        handles of this tree)."""
        node, end = self._check_handle(handle).node, self._check_handle(other).node
        while node is not end and node is not self._root:
            node = node.parent
        return node is end

    def path_of(self, handle: object) -> list[object]:
        """The nodes of a locked handle's path, its end first, as opaque keys (a node keeps
        its identity for as long as it is cached; splits put new nodes above it)."""
        node = self._check_handle(handle).node
        path: list[object] = []
        while node is not self._root:
            path.append(node)
            node = node.parent
        return path

    def lock_count(self, handle: object) -> int:
        """How many locks hold the end of a handle's path (0 for an empty match)."""
        node = self._check_handle(handle).node
        return 0 if node is self._root else node.lock_count

    def hint(self, handle: object, hint: str | int | None) -> None:
        """Give the end of a match handle's path a retention hint, which the `adaptive` policy
        uses (others ignore it) until that node's next hit: `session_end` (the prompt's unique
        tail, i.e. that node and its ancestors up to the first one with other children, will
        not be extended: evict it first), `keep` (the session continues: keep it with the
        frequently used), or none. Changes no lock, tick or structure."""
        code = parse_hint(hint)
        h = self._check_handle(handle)
        if h.node is not self._root and (h.num_locks or h.version == self._version):
            node = h.node  # an unlocked stale handle's node may have been evicted or split
            if h.num_blocks == len(node.block_ids) or h.num_locks:
                self._give_hint(node, code)

    def _give_hint(self, node: Node, code: int) -> None:
        if code == NO_HINT:
            return
        node.hint = code
        self._policy.touch(node)
        if code == SESSION_END:
            parent = node.parent
            while parent is not self._root and len(parent.children) == 1:
                parent.hint = code  # not a leaf: not in the policy
                parent = parent.parent

    def _check_handle(self, handle: object) -> Handle:
        if not isinstance(handle, Handle) or handle.tree is not self:
            raise InvalidArgument("not a match handle of this tree")
        return handle
