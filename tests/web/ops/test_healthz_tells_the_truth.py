"""/healthz: what is wrong, naming the campaign and what to do; 503 only while the site itself cannot serve.

A campaign's trouble (a dead aggregator, a stall) is the alerts' business: a
monitor that read it as the site being down paged for a campaign nobody had
joined yet (issue 34).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client, override_settings
from django.utils import timezone

from crowdtrain.campaigns.models import Step
from crowdtrain.ops import heartbeats
from crowdtrain.scheduler import endings, leasing
from crowdtrain.scheduler.models import Aggregator, SliceAssignment
from tests.conftest import FakeClock
from tests.factories import make_campaign, make_device, work_until_committed

pytestmark = pytest.mark.django_db


def test_a_campaign_with_ready_aggregators_is_ok() -> None:
    campaign = make_campaign()

    response = Client().get("/healthz")

    assert response.status_code == 200
    assert response.json() == {"status": "ok", "summary": "ok", "running_campaigns": 1, "alerts": []}
    assert campaign.pk


def test_a_running_campaign_whose_aggregator_is_not_ready_is_degraded() -> None:
    campaign = make_campaign()
    SliceAssignment.objects.filter(campaign=campaign).update(ready=False)

    response = Client().get("/healthz")

    assert response.status_code == 200
    body = response.json()
    assert (body["status"], body["summary"]) == ("degraded", "waiting for aggregators")
    [alert] = body["alerts"]
    assert alert["code"] == "campaign_waiting_for_aggregators" and alert["campaign_id"] == campaign.pk
    assert alert["severity"] == "critical" and "0 of its 1 aggregator slices ready" in alert["message"]
    assert "start aggregators" in alert["what_to_do"]


def test_a_running_campaign_without_any_aggregator_is_degraded() -> None:
    campaign = make_campaign()
    SliceAssignment.objects.filter(campaign=campaign).delete()

    alerts = Client().get("/healthz").json()["alerts"]

    assert [(a["code"], a["campaign_id"]) for a in alerts] == [("campaign_waiting_for_aggregators", campaign.pk)]


def test_a_disconnected_aggregator_is_named_as_silent() -> None:
    campaign = make_campaign()
    Aggregator.objects.filter(slices__campaign=campaign).update(connected=False)

    response = Client().get("/healthz")

    assert response.status_code == 200 and response.json()["summary"] == "aggregator down"
    [alert] = response.json()["alerts"]
    assert alert["code"] == "aggregator_silent" and alert["campaign_id"] == campaign.pk
    assert f"agg-{campaign.pk}-0" in alert["message"] and "--name" in alert["what_to_do"]


def test_an_aggregator_without_heartbeats_for_longer_than_gone_after_is_silent(clock: FakeClock) -> None:
    campaign = make_campaign()
    aggregator = Aggregator.objects.get(slices__campaign=campaign)
    heartbeats.aggregator_heard(aggregator.pk)

    with override_settings(CROWDTRAIN_GONE_AFTER_S=10.0):
        clock.advance(9)
        before = Client().get("/healthz")
        clock.advance(2)
        after = Client().get("/healthz")

    assert before.json()["status"] == "ok"
    assert after.status_code == 200 and after.json()["status"] == "degraded"
    assert "no heartbeat for 11 s" in after.json()["alerts"][0]["message"]


def test_a_running_campaign_that_has_not_stepped_for_ten_minutes_is_stalled() -> None:
    campaign = make_campaign()
    device, _ = make_device()
    work_until_committed(campaign, [device.pk], 1)
    leasing.request_lease(device.pk, campaign.pk, None)  # its volunteer is still there, working
    Step.objects.filter(campaign=campaign).update(committed_at=timezone.now() - timedelta(minutes=9))
    recent = Client().get("/healthz")
    Step.objects.filter(campaign=campaign).update(committed_at=timezone.now() - timedelta(minutes=11))

    stalled = Client().get("/healthz")

    assert recent.json()["status"] == "ok"
    assert stalled.status_code == 200
    assert (stalled.json()["status"], stalled.json()["summary"]) == ("degraded", "stalled with volunteers present")
    [alert] = stalled.json()["alerts"]
    assert alert["code"] == "campaign_stalled" and alert["campaign_id"] == campaign.pk
    assert "no step for 11 minutes" in alert["message"]


def test_a_running_campaign_nobody_has_joined_is_waiting_for_volunteers_not_critical() -> None:
    campaign = make_campaign()
    campaign.running_since = timezone.now() - timedelta(minutes=11)
    campaign.save(update_fields=["running_since"])

    response = Client().get("/healthz")

    assert response.status_code == 200
    body = response.json()
    assert (body["status"], body["summary"]) == ("warning", "no volunteers")
    [alert] = body["alerts"]
    assert (alert["code"], alert["severity"]) == ("campaign_waiting_for_volunteers", "warning")
    assert "nothing is broken" in alert["what_to_do"]


def test_a_volunteer_holding_a_lease_is_present_and_gone_once_it_gave_it_back() -> None:
    campaign = make_campaign()
    campaign.running_since = timezone.now() - timedelta(minutes=11)
    campaign.save(update_fields=["running_since"])
    device, _ = make_device()
    lease = leasing.request_lease(device.pk, campaign.pk, None)

    assert Client().get("/healthz").json()["summary"] == "stalled with volunteers present"
    assert endings.release_lease(device.pk, lease.lease_id)
    assert Client().get("/healthz").json()["summary"] == "no volunteers"


def test_a_site_that_cannot_read_its_database_is_down(monkeypatch: pytest.MonkeyPatch) -> None:
    from django.db import DatabaseError

    from crowdtrain.ops import health

    def broken(now: object = None) -> None:
        raise DatabaseError("connection refused")

    monkeypatch.setattr(health, "evaluate", broken)
    response = Client().get("/healthz")

    assert response.status_code == 503 and response.json()["status"] == "down"


def test_a_paused_campaign_is_nobodys_alert() -> None:
    campaign = make_campaign()
    SliceAssignment.objects.filter(campaign=campaign).delete()
    campaign.state = campaign.State.PAUSED
    campaign.save(update_fields=["state"])

    response = Client().get("/healthz")

    assert response.status_code == 200 and response.json()["alerts"] == []
