"""A full step's write, which the step after next waits on: the same statements whatever the number of
volunteers in it, rows the batched record had not written yet inserted whole, and the leaderboards fed
after the step is out rather than before."""

from __future__ import annotations

import threading
from typing import Any

import msgspec
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext, override_settings

from crowdtrain.accounts.models import Device
from crowdtrain.campaigns.models import Campaign
from crowdtrain.credit import boards, ledger
from crowdtrain.scheduler import leasing, reporting
from crowdtrain.scheduler.models import Lease
from crowdtrain.scheduler.reporting import DoneOutcome
from crowdtrain.verification import standing
from crowdtrain_agent.protocol import Lease as LeaseMessage
from tests.factories import done_for, make_campaign, make_device

pytestmark = pytest.mark.django_db


def _one_step(name: str, volunteers: int, *, compute_s: float = 0.5) -> tuple[Campaign, list[Device], list[int]]:
    """A campaign whose step is one lease of 4 samples per volunteer, every lease out and reported but the last."""
    campaign = make_campaign(target_batch_size=4 * volunteers, microbatch_size=4)
    devices = [make_device(f"{name}-{i}")[0] for i in range(volunteers)]
    leases = [leasing.request_lease(d.pk, campaign.pk, 0.2) for d in devices]  # a microbatch each
    assert all(isinstance(lease, LeaseMessage) for lease in leases), leases
    lease_ids = [lease.lease_id for lease in leases]  # type: ignore[union-attr]
    for device, lease_id in zip(devices[:-1], lease_ids[:-1], strict=True):
        assert reporting.report_done(device.pk, _done(lease_id, compute_s)).ack.accepted
    return campaign, devices, lease_ids


def _done(lease_id: int, compute_s: float) -> Any:
    return msgspec.structs.replace(done_for(lease_id, loss=2.0), compute_s=compute_s)


def _last_report(devices: list[Device], lease_ids: list[int], compute_s: float = 0.5) -> DoneOutcome:
    outcome = reporting.report_done(devices[-1].pk, _done(lease_ids[-1], compute_s))
    assert outcome.ack.accepted and [c.message.step for c in outcome.commits] == [0]
    return outcome


def test_a_steps_write_takes_as_many_statements_for_twenty_volunteers_as_for_three() -> None:
    counts = {}
    for volunteers in (3, 20):
        _, devices, lease_ids = _one_step(f"crowd{volunteers}", volunteers)
        standing.clear_caches()  # as in a site process that never served these devices (two sites: half of them)
        with CaptureQueriesContext(connection) as queries:
            _last_report(devices, lease_ids)
        counts[volunteers] = len(queries.captured_queries)

    assert counts[3] == counts[20], counts


def test_lease_rows_the_record_had_not_written_are_inserted_whole_and_written_ones_updated() -> None:
    campaign, devices, lease_ids = _one_step("rows", 4)
    written = Lease.objects.get(pk=lease_ids[0])
    # Two rows another process issued, whose batch had not reached the database when the step filled.
    unwritten = {r.pk: (r.ranges, r.device_id, r.issued_at) for r in Lease.objects.filter(pk__in=lease_ids[1:3])}
    Lease.objects.filter(pk__in=lease_ids[1:3]).delete()

    _last_report(devices, lease_ids)

    rows = {r.pk: r for r in Lease.objects.filter(pk__in=lease_ids)}
    assert sorted(rows) == sorted(lease_ids)
    assert {(r.state, r.step.index, r.loss_sum) for r in rows.values()} == {(Lease.State.ACCEPTED, 0, 8.0)}  # type: ignore[union-attr]  # loss 2 x 4 samples
    for pk, (ranges, device_id, issued_at) in unwritten.items():
        assert (rows[pk].ranges, rows[pk].device_id, rows[pk].campaign_id) == (ranges, device_id, campaign.pk)
        assert abs((rows[pk].issued_at - issued_at).total_seconds()) < 1e-3
    assert rows[written.pk].ranges == written.ranges
    assert all(0 < r.compute_s <= 0.5 for r in rows.values())  # type: ignore[operator]


def test_a_device_that_reported_no_compute_time_is_credited_and_keeps_its_speed() -> None:
    _, devices, lease_ids = _one_step("untimed", 2, compute_s=0.0)
    Device.objects.filter(pk=devices[0].pk).update(samples_per_s=12.5)

    _last_report(devices, lease_ids, compute_s=0.0)

    speeds = dict(Device.objects.filter(pk__in=[d.pk for d in devices]).values_list("pk", "samples_per_s"))
    accepted = dict(Device.objects.filter(pk__in=[d.pk for d in devices]).values_list("pk", "samples_accepted"))
    assert speeds == {devices[0].pk: 12.5, devices[1].pk: 0.0}
    assert accepted == {devices[0].pk: 4, devices[1].pk: 4}


@pytest.mark.django_db(transaction=True)  # the leaderboards are fed once the step's transaction commits
def test_the_step_is_out_before_the_leaderboards_count_it_and_they_count_it_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    campaign, devices, lease_ids = _one_step("boards", 2)
    started, release, added = threading.Event(), threading.Event(), threading.Event()
    real_add = boards.add

    def slow_add(deltas: Any, now: float | None = None) -> None:
        started.set()
        assert release.wait(10), "the test never let the leaderboards go on"
        real_add(deltas, now)
        added.set()

    monkeypatch.setattr(boards, "add", slow_add)
    with override_settings(CROWDTRAIN_RECORDS_INLINE=False):
        _last_report(devices, lease_ids)  # returns with the leaderboards' update still held up

    assert started.wait(10), "the commit's credit never reached the leaderboards' thread"
    assert Campaign.objects.get(pk=campaign.pk).committed_steps == 1
    assert not added.is_set()
    release.set()
    assert added.wait(10)
    ledger._boards_thread.submit(lambda: None).result(10)  # the thread is idle again
    rows, _ = boards.page(campaign.pk, "volunteers", "all", 0, 10)
    assert sorted(r.subject_id for r in rows) == sorted(d.owner_id for d in devices)
