"""Shared test configuration: hypothesis profiles.

HYPOTHESIS_PROFILE picks one: "ci" (the default, also under CI=true) or "thorough". Without
hypothesis installed (a lent GPU machine running scripts/gpu_check) there is nothing to set.
"""

from __future__ import annotations

import os

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # pragma: no cover
    pass
else:
    for name, examples in (("ci", 300), ("thorough", 3000)):
        settings.register_profile(name, max_examples=examples, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
