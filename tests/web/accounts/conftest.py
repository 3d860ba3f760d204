"""Accounts tests: the owner, teammate and stranger personas, and a fresh cache per test (allauth's rate limits)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.contrib.auth.models import AbstractBaseUser
from django.test import override_settings

from tests.factories import make_volunteer


@pytest.fixture(autouse=True)
def fresh_cache(request: pytest.FixtureRequest) -> Iterator[None]:
    # A LocMemCache named after the test: the Redis cache of the services run
    # would otherwise keep failed-login counts from one test (or run) to the next.
    location = f"accounts-test-{request.node.nodeid}"
    with override_settings(CACHES={"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache",
                                               "LOCATION": location}}):  # fmt: skip
        yield


@pytest.fixture
def owner() -> AbstractBaseUser:
    return make_volunteer("owner")


@pytest.fixture
def teammate() -> AbstractBaseUser:
    return make_volunteer("teammate")


@pytest.fixture
def stranger() -> AbstractBaseUser:
    return make_volunteer("stranger")
