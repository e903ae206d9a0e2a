"""The cluster tests' shared parts: every module here needs etcd (Debian's etcd-server), and
most start members with the tiny layout."""

from __future__ import annotations

import shutil
from typing import Any

import pytest
from _server import tiny_flags


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test here boots etcd: `slow`, and skipped where etcd is not installed."""
    here = __file__.rsplit("/", 1)[0] + "/"
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.slow)
            if shutil.which("etcd") is None:
                item.add_marker(pytest.mark.skip(
                    reason="etcd is not installed (apt-get install etcd-server; "
                    "scripts/bootstrap --tests does it)"))


@pytest.fixture
def flags(tmp_path: Any) -> tuple[str, ...]:
    """`radixkv serve` flags for the tiny layout (its config in the test's tmp_path)."""
    return tiny_flags(str(tmp_path))
