"""The admin dashboard: staff only, its snapshot says what the database says, alerts show, a week stays small."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.db.models import Count
from django.test import Client
from django.utils import timezone

from crowdtrain.asgi import application
from crowdtrain.campaigns.models import Step
from crowdtrain.ops import dashboard, history
from crowdtrain.ops.aggregator_probe import probe
from crowdtrain.ops.models import SITE, DashboardSample
from crowdtrain.scheduler.hotstate import hot_state
from crowdtrain.scheduler.models import Aggregator, Lease, SliceAssignment
from tests.factories import logged_in, make_admin, make_campaign, make_device, make_volunteer, work_until_committed


@pytest.fixture(autouse=True)
def fresh_dashboard() -> Iterator[None]:
    """Per-process caches start empty, and lease outcomes count from here (the counter is process-wide)."""
    history.history_cache.clear()
    dashboard.shared.clear()
    probe._readings.clear()
    history.outcome_deltas.take()
    yield
    history.history_cache.clear()
    dashboard.shared.clear()


@pytest.mark.django_db
def test_only_staff_see_the_dashboard_page() -> None:
    anonymous, volunteer, admin = logged_in(), logged_in(make_volunteer("stranger")), logged_in(make_admin("admin"))

    page = admin.get("/dashboard/")

    assert anonymous.get("/dashboard/").status_code == 302
    assert "/login" in anonymous.get("/dashboard/")["Location"]
    assert volunteer.get("/dashboard/").status_code == 403
    assert page.status_code == 200
    html = page.content.decode()
    assert "build/charts.js" in html and "js/dashboard.js" in html
    assert 'href="/dashboard/"' in html  # the staff nav links it
    assert 'href="/dashboard/"' not in volunteer.get("/").content.decode()


@pytest.mark.django_db
def test_the_snapshot_says_what_the_database_says() -> None:
    campaign = make_campaign()
    devices = [make_device(f"v{i}", name=f"gpu-{i}")[0] for i in range(2)]
    work_until_committed(campaign, [d.pk for d in devices], 3)
    hot_state().mark_seen([d.pk for d in devices])
    history.record_minute(timezone.now() + timedelta(minutes=1))  # this process's outcomes, as housekeeping writes

    snapshot = dashboard.build()

    campaign.refresh_from_db()
    row = next(c for c in snapshot["campaigns"] if c["id"] == campaign.pk)
    assert row["committed_steps"] == campaign.committed_steps >= 3
    by_minute: dict = {}
    for step in Step.objects.filter(campaign=campaign):
        counts = by_minute.setdefault(history.minute_of(step.committed_at), [0, 0.0])
        counts[0] += step.num_samples
        counts[1] += step.loss_sum
    newest = by_minute[max(by_minute)]
    assert row["training_loss"] == pytest.approx(newest[1] / newest[0])
    assert snapshot["agents"]["online"] == 2
    assert {a["name"] for a in snapshot["agents"]["recent"]} == {"gpu-0", "gpu-1"}
    assert all(a["samples_per_s"] and a["samples_per_s"] > 0 for a in snapshot["agents"]["recent"])
    accepted = sum(r["count"] for r in snapshot["lease_reasons"] if r["state"] == "accepted")
    assert accepted == Lease.objects.filter(campaign=campaign, state=Lease.State.ACCEPTED).count() > 0
    assert snapshot["celery"]["queue"]["depth"] is None  # the embedded broker: said so, not a made-up 0
    assert "in-memory broker" in snapshot["celery"]["queue"]["note"]
    json.dumps(snapshot, default=str)  # it goes over the socket as JSON


@pytest.mark.django_db
def test_a_slice_not_ready_and_a_disconnected_aggregator_show_as_alerts_with_what_to_do() -> None:
    waiting, silent = make_campaign(), make_campaign()
    SliceAssignment.objects.filter(campaign=waiting).update(ready=False)
    Aggregator.objects.filter(slices__campaign=silent).update(connected=False)

    snapshot = dashboard.build()

    codes = {(a["code"], a["campaign_id"]) for a in snapshot["alerts"]}
    assert ("campaign_waiting_for_aggregators", waiting.pk) in codes
    assert ("aggregator_silent", silent.pk) in codes
    assert all(a["what_to_do"] for a in snapshot["alerts"])
    assert snapshot["status"] == "degraded"
    names = {a["name"]: a for a in snapshot["aggregators"]}
    assert names[f"agg-{silent.pk}-0"]["healthy"] is False


@pytest.mark.django_db
def test_a_week_of_minutes_is_served_as_a_bounded_number_of_points() -> None:
    now = timezone.now()
    start = history.minute_of(now) - history.WEEK
    rows = [
        DashboardSample(
            minute=start + timedelta(minutes=i), source=SITE,
            data={"agents": 999 if i == 5000 else 3, "by_kind": {}, "joins": 1, "departures": 0, "campaigns": {}},
        )
        for i in range(7 * 24 * 60)
    ]  # fmt: skip
    DashboardSample.objects.bulk_create(rows)

    series = history.series({}, agents_now=3, now=now)

    stored = [t for t in series["t"] if t < history.minute_of(now).timestamp() - 60]
    assert len(series["t"]) <= history.MAX_POINTS + history.LIVE_MINUTES
    assert len(series["t"]) > history.MAX_POINTS // 2  # downsampled, not cut off
    assert series["t"][0] == int(start.timestamp())  # the whole week is there
    assert max(series["agents"]) == 999  # a peak survives downsampling
    assert sum(j for j in series["joins"][: len(stored)] if j) == 7 * 24 * 60 - sum(
        1 for r in rows if r.minute.timestamp() >= stored[-1] + series["bucket_s"]
    )


@pytest.mark.django_db
def test_the_minute_row_counts_each_campaigns_steps_once_even_if_written_twice() -> None:
    campaign = make_campaign()
    device, _ = make_device()
    work_until_committed(campaign, [device.pk], 2)
    later = timezone.now() + timedelta(minutes=1)

    first = history.record_minute(later)
    second = history.record_minute(later)

    assert (first, second) == (True, False)
    row = DashboardSample.objects.get(source=SITE)
    steps = Step.objects.filter(campaign=campaign, committed_at__gte=row.minute).aggregate(n=Count("id"))["n"]
    assert row.data["campaigns"][str(campaign.pk)]["steps"] == steps


async def _socket(user_name: str | None, *, staff: bool) -> WebsocketCommunicator:
    headers = [(b"origin", b"http://localhost"), (b"host", b"localhost")]
    if user_name is not None:
        client = Client()
        user = await sync_to_async(make_admin if staff else make_volunteer)(user_name)
        await sync_to_async(client.force_login)(user)
        headers.append((b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode()))
    return WebsocketCommunicator(application, "/ws/dashboard/", headers=headers)


@pytest.mark.django_db(transaction=True)
async def test_the_socket_closes_with_4003_for_anyone_but_staff() -> None:
    for name in (None, "stranger"):
        communicator = await _socket(name, staff=False)
        connected, _ = await communicator.connect()

        closed = await communicator.receive_output(timeout=5)

        assert connected
        assert closed == {"type": "websocket.close", "code": 4003}
        await communicator.disconnect()


@pytest.mark.django_db(transaction=True)
async def test_the_socket_sends_staff_a_snapshot_at_once_and_again() -> None:
    campaign = await sync_to_async(make_campaign)()
    communicator = await _socket("admin", staff=True)
    connected, _ = await communicator.connect()

    first = json.loads(await communicator.receive_from(timeout=10))
    second = json.loads(await communicator.receive_from(timeout=10))

    assert connected
    assert [c["id"] for c in first["campaigns"]] == [campaign.pk]
    assert {"alerts", "agents", "aggregators", "series", "errors", "celery"} <= set(first)
    assert second["at"] >= first["at"]
    await communicator.disconnect()
