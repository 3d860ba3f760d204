"""The lease record writer sends a batch when it is old enough or, sooner, when it is big enough."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from django.db import DatabaseError
from django.utils import timezone

from crowdtrain.scheduler import records
from crowdtrain.scheduler.models import Lease


def _ended(lease_id: int) -> records.Finished:
    return records.Finished(lease_id, Lease.State.EXPIRED, "agent went silent", timezone.now())


def test_a_batch_short_of_the_size_waits_for_the_interval() -> None:
    writer = records.RecordWriter(inline=False, thread=False)

    for lease_id in range(records.FLUSH_AT_RECORDS - 1):
        writer.lease_finished(_ended(lease_id))

    assert not writer._wake.is_set()


def test_a_full_batch_calls_the_writer_thread_at_once() -> None:
    writer = records.RecordWriter(inline=False, thread=False)

    for lease_id in range(records.FLUSH_AT_RECORDS):
        writer.lease_finished(_ended(lease_id))

    assert writer._wake.is_set()


class _Stop(BaseException):
    """Ends the writer's endless loop in a test (the loop carries on after any Exception)."""


def test_a_database_outage_pauses_the_writer_though_new_leases_keep_calling_it(monkeypatch: pytest.MonkeyPatch) -> None:
    writer = records.RecordWriter(inline=False, thread=False)
    tries: list[int] = []
    paused: list[float] = []

    def failing_flush() -> None:
        tries.append(1)
        if len(tries) == 3:
            raise _Stop
        writer._wake.set()  # leases go on in Redis meanwhile, and the queue stays past FLUSH_AT_RECORDS
        raise DatabaseError("the database is away")

    def sleep(seconds: float) -> None:
        paused.append(seconds)

    monkeypatch.setattr(writer, "flush", failing_flush)
    monkeypatch.setattr(records, "refresh_if_due", lambda: None)
    monkeypatch.setattr(records, "time", SimpleNamespace(sleep=sleep))

    with pytest.raises(_Stop):
        writer._loop()

    assert paused == [1.0, 1.0]  # a pause after each failed write, not a tight loop of connection attempts
