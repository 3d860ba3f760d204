"""Accounts tests: a fresh cache per test, so allauth's rate-limit counters never leak between tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.test import override_settings


@pytest.fixture(autouse=True)
def fresh_cache(request: pytest.FixtureRequest) -> Iterator[None]:
    # A LocMemCache named after the test: the Redis cache of the services run
    # would otherwise keep failed-login counts from one test (or run) to the next.
    location = f"accounts-test-{request.node.nodeid}"
    with override_settings(CACHES={"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache",
                                               "LOCATION": location}}):  # fmt: skip
        yield
