"""The SGLang tests' two worker processes, started once per test session (SGLang's imports
take a while) and shared by the modules here."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from _sglang_workers import Worker, start_workers


@pytest.fixture(scope="session")
def sglang_workers() -> Iterator[dict[str, Worker]]:
    yield from start_workers()


@pytest.fixture(scope="module")
def workers(sglang_workers: dict[str, Worker]) -> dict[str, Worker]:
    """The shared workers, their error logs emptied: what a module before logged is not this
    module's."""
    for w in sglang_workers.values():
        w("errors")
    return sglang_workers
