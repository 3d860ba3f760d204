"""Shared fixtures: storage in a temporary folder for every test."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.test import override_settings
from hypothesis import settings as hypothesis_settings

# Browser tests run only when named (`pytest tests/browser`, make test's third pass): a sync
# Playwright page leaves an event loop behind that breaks every later async test in the process.
collect_ignore = ["browser"]


def pytest_configure(config: pytest.Config) -> None:
    """No persistent database connections in the test process.

    Channels runs a consumer's queries in executor threads; with CONN_MAX_AGE
    their connections outlive the test, and PostgreSQL then refuses to drop
    the test database ("being accessed by other users"). The sites that
    end-to-end tests start keep the production setting.
    """
    from django.conf import settings as django_settings

    django_settings.DATABASES["default"]["CONN_MAX_AGE"] = 0
    # The lease record is written in the test's own thread and transaction, not by a background thread.
    django_settings.CROWDTRAIN_RECORDS_INLINE = True
    # Tests look at a task's outcome right after the request that queued it.
    django_settings.CROWDTRAIN_EAGER_TASKS_IN_BACKGROUND = False
    # No test exports a gradient graph for browsers (seconds of CPU each) unless it turns this on.
    django_settings.CROWDTRAIN_BROWSER_GRAPHS = False


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Before the last test's teardown drops the test database, close the connections dead threads left.

    The scheduler's calls run in a pool of threads (``gateway.offloop``), each
    with its own connection, and each test's event loop has its own pool. When
    a pool's threads end, their connections stay open until the garbage
    collector frees them, and PostgreSQL refuses to drop a database with
    sessions on it ("being accessed by other users").
    """
    if nextitem is None:
        gc.collect()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` run where PyTorch sees a CUDA device; elsewhere they are skipped, saying so."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU, and PyTorch sees none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Timing varies a lot on 2 shared cores (first calls import and warm up torch): no deadlines.
hypothesis_settings.register_profile("crowdtrain", deadline=None)
hypothesis_settings.load_profile("crowdtrain")


@pytest.fixture(autouse=True)
def fresh_channel_layer() -> Iterator[None]:
    """Every test gets its own channel layer.

    channels_redis keeps asyncio locks per layer instance, bound to the event
    loop that first used them; pytest-asyncio gives each test a new loop, and a
    lock a finished test left held would block the next test's consumers
    ("bound to a different event loop").
    """
    from channels.layers import channel_layers

    channel_layers.backends.clear()
    yield
    channel_layers.backends.clear()


@pytest.fixture(autouse=True)
def fresh_scheduler_state() -> Iterator[None]:
    """Every test gets its own scheduler keys in Redis (or its own in-process Redis) and empty caches.

    Lease ids and campaign ids come back after a rolled-back test transaction;
    keys a finished test left behind must not speak for the next test's leases.
    """
    import uuid

    from crowdtrain.scheduler import browser_tabs, configs, hotstate, ids, records
    from crowdtrain.verification import checks, standing

    prefix = f"ct-test-{uuid.uuid4().hex[:12]}"
    with override_settings(CROWDTRAIN_REDIS_PREFIX=prefix, CROWDTRAIN_RECORDS_INLINE=True):
        hotstate.reset_hot_state()
        records.reset_writer()
        configs.clear_caches()
        browser_tabs.clear_caches()
        ids.lease_ids.reset()
        standing.clear_caches()
        checks.clear_caches()
        yield
        state = hotstate._instance
        if state is not None:
            _delete_namespace(state.client, prefix)
        hotstate.reset_hot_state()
        records.reset_writer()
        configs.clear_caches()
        browser_tabs.clear_caches()
        ids.lease_ids.reset()
        standing.clear_caches()
        checks.clear_caches()


@pytest.fixture(autouse=True)
def referee_at_once(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The referee's work runs in the calling thread, where the test's database transaction is.

    No version is kept unless a test asks for it (``CROWDTRAIN_REFEREE_VERSIONS_KEPT``): keeping one
    fetches it from the aggregators, which most tests do not run.
    """
    from crowdtrain.verification import referee

    monkeypatch.setattr(referee, "in_background", lambda task, *args, lane="rule": task.run(*args))
    with override_settings(CROWDTRAIN_REFEREE_VERSIONS_KEPT=0):
        yield


def redis_lost_its_keys() -> None:
    """A Redis restarted without persistence, as the scheduler sees it: every key of its namespace gone.

    The test's own namespace (``fresh_scheduler_state``), not FLUSHALL, which would empty every
    database of whatever Redis the tests were pointed at.
    """
    from django.conf import settings as django_settings

    from crowdtrain.scheduler.hotstate import hot_state

    _delete_namespace(hot_state().client, django_settings.CROWDTRAIN_REDIS_PREFIX)


def _delete_namespace(client: Any, prefix: str) -> None:
    keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        client.delete(*keys)


class FakeClock:
    """The scheduler's clock, moved by hand: deadlines pass without waiting for them."""

    def __init__(self) -> None:
        import time

        self.now = time.time()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> Iterator[FakeClock]:
    from crowdtrain.scheduler.hotstate import hot_state

    fake = FakeClock()
    hot_state().clock = fake
    yield fake


@pytest.fixture(autouse=True)
def media_root(tmp_path: Path) -> Iterator[Path]:
    """Shards written by a test land in its own folder (FileSystemStorage follows MEDIA_ROOT changes)."""
    root = tmp_path / "media"
    with override_settings(MEDIA_ROOT=str(root)):
        yield root
