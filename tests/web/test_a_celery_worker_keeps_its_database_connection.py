"""A Celery worker keeps its database connection from task to task, as a site process's threads do.

Driven through the signals a worker sends around each task, with Celery's own
Django fixup connected to them as in a running worker.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery import signals
from celery.fixups.django import DjangoWorkerFixup
from django.db import connection

from crowdtrain.celery import app
from crowdtrain.lib import connections
from crowdtrain.verification.tasks import judge_check

pytestmark = pytest.mark.django_db(transaction=True)  # autocommit, as a worker runs


@pytest.fixture
def worker_fixup(monkeypatch: pytest.MonkeyPatch) -> Iterator[DjangoWorkerFixup]:
    # A worker's setting (the test process keeps none, tests/conftest.py), on this thread's connection.
    monkeypatch.setitem(connection.settings_dict, "CONN_MAX_AGE", 600)
    connection.close()
    fixup = DjangoWorkerFixup(app).install()
    yield fixup
    signals.beat_embedded_init.disconnect(fixup.close_database)
    signals.task_prerun.disconnect(fixup.on_task_prerun)
    signals.task_postrun.disconnect(fixup.on_task_postrun)
    signals.worker_process_init.disconnect(fixup.on_worker_process_init)
    connection.close()


def _run_a_task() -> None:
    """What a worker does around a task, the task itself a query."""
    signals.task_prerun.send(sender=judge_check, task_id="t", task=judge_check, args=(), kwargs={})
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    signals.task_postrun.send(sender=judge_check, task_id="t", task=judge_check, args=(), kwargs={})


def test_three_tasks_in_a_row_use_one_connection(worker_fixup: DjangoWorkerFixup) -> None:
    connection.ensure_connection()
    first = connection.connection

    for _ in range(3):
        _run_a_task()

    assert first is not None and connection.connection is first


def test_a_broken_connection_is_replaced_before_the_next_task(
    worker_fixup: DjangoWorkerFixup, monkeypatch: pytest.MonkeyPatch
) -> None:
    connection.ensure_connection()
    broken = connection.connection
    monkeypatch.setattr(connections._checked, "at", float("inf"))  # no periodic check due: the failure must call one
    connection.errors_occurred = True
    monkeypatch.setattr(connection, "is_usable", lambda: False)  # as a connection PostgreSQL's restart cut reads

    _run_a_task()

    assert connection.connection is not None and connection.connection is not broken
    assert not connection.errors_occurred
