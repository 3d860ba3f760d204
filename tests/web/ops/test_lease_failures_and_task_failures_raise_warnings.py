"""A spike of expired or rejected leases, and a Celery task that failed lately, are warnings: 200, named."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery import shared_task
from django.test import Client

from crowdtrain.lib import metrics
from crowdtrain.ops.health import MIN_OUTCOMES, TASK_FAILURE_WINDOW_S
from tests.conftest import FakeClock
from tests.factories import make_campaign

from .scrape import scrape, value

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def empty_window() -> Iterator[None]:
    metrics.outcomes.clear()
    yield
    metrics.outcomes.clear()


def test_more_than_half_the_leases_failing_is_a_warning_naming_the_campaign() -> None:
    campaign = make_campaign()
    for _ in range(MIN_OUTCOMES // 2 - 1):
        metrics.lease_ended(campaign.pk, "accepted", "")
    for _ in range(MIN_OUTCOMES // 2 + 1):
        metrics.lease_ended(campaign.pk, "expired", "deadline passed")

    response = Client().get("/healthz")

    assert response.status_code == 200 and response.json()["status"] == "warning"
    [alert] = response.json()["alerts"]
    assert alert["code"] == "lease_failures_spike" and alert["campaign_id"] == campaign.pk
    assert "11 of the last 20 leases" in alert["message"] and "deadline passed" in alert["what_to_do"]


def test_half_the_leases_failing_or_too_few_leases_is_no_alert() -> None:
    campaign = make_campaign()
    for _ in range(MIN_OUTCOMES // 2):
        metrics.lease_ended(campaign.pk, "accepted", "")
        metrics.lease_ended(campaign.pk, "rejected", "stale version: computed on 1, step 3 is open")
    other = make_campaign()
    for _ in range(MIN_OUTCOMES - 1):
        metrics.lease_ended(other.pk, "expired", "deadline passed")

    response = Client().get("/healthz")

    assert response.json()["alerts"] == []


@shared_task(name="tests.ops.always_fails")
def always_fails() -> None:
    raise RuntimeError("this task always fails")


def test_a_failed_celery_task_is_counted_and_alerts_for_fifteen_minutes(clock: FakeClock) -> None:
    # As a worker runs it (eager mode with propagation re-raises before Celery's failure handling).
    result = always_fails.apply(throw=False)

    firing = Client().get("/healthz").json()["alerts"]
    samples = scrape(Client())
    clock.advance(TASK_FAILURE_WINDOW_S + 1)
    later = Client().get("/healthz").json()["alerts"]

    assert [(a["code"], a["campaign_id"]) for a in firing] == [("celery_task_failing", None)]
    assert "tests.ops.always_fails" in firing[0]["message"]
    assert value(samples, "crowdtrain_celery_task_failures_total", task="tests.ops.always_fails") == 1
    assert value(samples, "crowdtrain_alert", code="celery_task_failing", campaign="", severity="warning") == 1
    assert later == []
    assert result.failed()
