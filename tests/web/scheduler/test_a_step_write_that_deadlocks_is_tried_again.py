"""A step's write that PostgreSQL aborts (a deadlock with another process's batch of records) is run again
at once, not left to the sweep's takeover ten seconds later; the report that filled it is counted once."""

from __future__ import annotations

import pytest
from django.db import OperationalError

from crowdtrain.scheduler import commits, leasing, reporting
from tests.factories import done_for, make_campaign, make_device

pytestmark = pytest.mark.django_db


def test_a_step_write_that_deadlocks_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    campaign = make_campaign(target_batch_size=8, microbatch_size=4)
    device, _ = make_device()
    lease = leasing.request_lease(device.pk, None, 1000.0)
    real_write = commits._write_step_once
    failures = iter([OperationalError("deadlock detected")])

    def deadlock_once(*args: object) -> list[int]:
        failure = next(failures, None)
        if failure is not None:
            raise failure
        return real_write(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(commits, "_write_step_once", deadlock_once)
    outcome = reporting.report_done(device.pk, done_for(lease.lease_id))

    assert outcome.ack.accepted and [c.message.step for c in outcome.commits] == [0]
    campaign.refresh_from_db()
    assert campaign.committed_steps == 1
