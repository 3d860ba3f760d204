"""Each site process keeps volunteers' records and devices' owners in memory, reloaded in bulk.

Read one at a time, 5,000 volunteers each leasing twice a minute cost a
query on most of their reports (the scale bench's even phase at 5,000
agents: 14% of the site's CPU). The owner comes with the device's token
check; the records in use are reloaded by the housekeeping round, a query
per 5,000, before they are due.
"""

from __future__ import annotations

import time

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from crowdtrain.verification import standing
from crowdtrain.verification.models import Standing
from tests.factories import make_device

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _fresh_caches() -> None:
    standing.clear_caches()


def test_an_owner_noted_at_the_token_check_is_not_read_again() -> None:
    device, _ = make_device()
    standing.note_owner(device.pk, device.owner_id)

    with CaptureQueriesContext(connection) as queries:
        owner = standing.owner_of(device.pk)

    assert (owner, len(queries)) == (device.owner_id, 0)


def test_records_in_use_are_reloaded_in_one_query_before_they_are_due() -> None:
    devices = [make_device(f"volunteer{n}")[0] for n in range(3)]
    volunteers = [d.owner_id for d in devices]
    for volunteer in volunteers:
        assert standing.record_of(volunteer) == standing.Record()
    Standing.objects.create(volunteer_id=volunteers[0], checks_passed=12, streak=12)  # judged elsewhere

    with CaptureQueriesContext(connection) as refresh:
        reloaded = standing.refresh_records(now=time.monotonic() + standing.RECORD_REFRESH_AT_S + 1)
    with CaptureQueriesContext(connection) as reads:
        records = [standing.record_of(v) for v in volunteers]

    assert (reloaded, len(refresh)) == (3, 1)
    assert len(reads) == 0
    assert records == [standing.Record(12, 12), standing.Record(), standing.Record()]


def test_records_not_due_yet_are_left_and_no_query_is_made() -> None:
    volunteer = make_device()[0].owner_id
    standing.record_of(volunteer)

    with CaptureQueriesContext(connection) as queries:
        assert standing.refresh_records() == 0

    assert len(queries) == 0


def test_records_nobody_read_for_a_while_are_dropped_not_reloaded() -> None:
    volunteer = make_device()[0].owner_id
    standing.record_of(volunteer)

    with CaptureQueriesContext(connection) as queries:
        reloaded = standing.refresh_records(now=time.monotonic() + standing.RECORDS_IN_USE_S + 1)

    assert (reloaded, len(queries)) == (0, 0)
    assert volunteer not in standing._records


def test_a_record_this_process_changed_meanwhile_is_not_overwritten_by_the_reload(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``remember`` during the reload's query: the reload read the row before that change was committed."""
    volunteer = make_device()[0].owner_id
    standing.record_of(volunteer)
    later = time.monotonic() + standing.RECORD_REFRESH_AT_S + 1
    changed = standing.Record(3, 3)
    reads = Standing.objects.filter

    def read_then_changed(*args: object, **kwargs: object) -> object:
        rows = reads(*args, **kwargs)
        standing._records[volunteer] = (later + 0.5, changed)  # remembered a moment later
        return rows

    monkeypatch.setattr(Standing.objects, "filter", read_then_changed)
    standing.refresh_records(now=later)

    assert standing.record_of(volunteer) == changed
