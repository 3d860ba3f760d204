"""A step's write locks its devices' rows without blocking other transactions that write lease rows of those
devices (the record writer, another site's commit).

The scale bench at 300 agents found "deadlock detected" every few steps: the step's
``SELECT … FOR UPDATE`` on its devices blocked the record writer's foreign-key checks
(KEY SHARE) on them, while the record writer held lease rows the step then updated.
PostgreSQL breaks such a cycle only after ``deadlock_timeout`` (1 s), which the step
and every agent waiting on it paid. The device lock is now FOR NO KEY UPDATE, the lock
the UPDATE takes anyway, which foreign-key checks do not wait for.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.utils import timezone

from crowdtrain.scheduler import commits
from crowdtrain.scheduler.hotrecords import lease_record
from crowdtrain.scheduler.models import Lease
from tests.factories import make_campaign, make_device

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(connection.vendor != "postgresql", reason="row locks are PostgreSQL's; the second pass runs it"),
]


def test_a_lease_row_of_a_device_the_step_is_crediting_is_written_without_waiting() -> None:
    campaign = make_campaign(target_batch_size=8, microbatch_size=4)
    device, _ = make_device()
    locked, finish = threading.Event(), threading.Event()

    def step_write() -> None:  # a step's credit, held open as a slow commit holds it
        try:
            with transaction.atomic():
                commits._credit([lease_record({"id": 1, "d": device.pk, "s": 0, "n": 4, "b": 0, "r": [[0, 0, 4]],
                                               "st": "accepted", "t0": 0.0, "dl": 0.0, "cs": 1.0})])  # fmt: skip
                locked.set()
                finish.wait(10)
        finally:
            connection.close()

    writer = threading.Thread(target=step_write)
    writer.start()
    assert locked.wait(5)
    try:
        with transaction.atomic():  # the record writer's batch: a new lease row of that device
            with connection.cursor() as db:
                db.execute("SET LOCAL lock_timeout = '2s'")  # waiting at all would fail here, not hang
            Lease.objects.create(
                campaign=campaign, device=device, base_version=0, ranges=[[0, 0, 4]], num_samples=4,
                deadline=timezone.now() + timedelta(minutes=1),
            )  # fmt: skip
    finally:
        finish.set()
        writer.join()

    assert Lease.objects.filter(device=device).count() == 1
