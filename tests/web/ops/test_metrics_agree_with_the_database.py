"""One scrape of /metrics, parsed as Prometheus parses it, says what the database says."""

from __future__ import annotations

import pytest
from django.db.models import Sum
from django.test import Client

from crowdtrain.campaigns.models import Step, ValidationResult
from crowdtrain.scheduler import endings, leasing
from crowdtrain.scheduler.hotstate import hot_state
from crowdtrain.scheduler.models import Aggregator, Lease, SliceAssignment
from crowdtrain.verification.models import Standing
from tests.conftest import FakeClock
from tests.factories import make_campaign, make_device, make_user, work_until_committed

from .scrape import scrape, value

pytestmark = pytest.mark.django_db


def test_steps_samples_losses_and_active_leases_are_the_databases() -> None:
    campaign = make_campaign()
    devices = [make_device(f"v{i}")[0] for i in range(2)]
    work_until_committed(campaign, [d.pk for d in devices], 3)
    out = leasing.request_lease(devices[0].pk, campaign.pk, None)
    ValidationResult.objects.create(campaign=campaign, version=2, loss=2.5, num_samples=10)
    label = str(campaign.pk)

    samples = scrape(Client())

    campaign.refresh_from_db()
    newest = Step.objects.filter(campaign=campaign).order_by("-index").first()
    assert newest is not None
    assert value(samples, "crowdtrain_campaign_committed_steps", campaign=label) == campaign.committed_steps >= 3
    assert (
        value(samples, "crowdtrain_campaign_samples_total", campaign=label)
        == (Step.objects.filter(campaign=campaign).aggregate(n=Sum("num_samples"))["n"])
    )
    assert value(samples, "crowdtrain_campaign_training_loss", campaign=label) == pytest.approx(newest.loss)
    assert value(samples, "crowdtrain_campaign_validation_loss", campaign=label) == 2.5
    assert (
        value(samples, "crowdtrain_leases_active", campaign=label)
        == (Lease.objects.filter(campaign=campaign, state=Lease.State.ACTIVE).count())
        == 1
    )
    assert out.lease_id
    assert value(samples, "crowdtrain_campaigns", state="running") == 1


def test_lease_outcome_counters_move_by_what_the_database_recorded(clock: FakeClock) -> None:
    campaign = make_campaign()
    device, _ = make_device()
    label = str(campaign.pk)
    before = scrape(Client())

    work_until_committed(campaign, [device.pk], 2)
    overdue = leasing.request_lease(device.pk, campaign.pk, None)
    clock.advance(overdue.deadline_s + 60)
    endings.expire_all_overdue()
    after = scrape(Client())

    def moved(state: str, reason: str) -> float:
        name = "crowdtrain_lease_outcomes_total"
        labels = {"campaign": label, "state": state, "reason": reason}
        return (value(after, name, **labels) or 0) - (value(before, name, **labels) or 0)

    accepted = Lease.objects.filter(campaign=campaign, state=Lease.State.ACCEPTED).count()
    expired = Lease.objects.filter(campaign=campaign, state=Lease.State.EXPIRED).count()
    assert moved("accepted", "") == accepted >= 2
    assert moved("expired", "deadline passed") == expired == 1


def test_agents_aggregators_and_quarantined_volunteers_are_counted() -> None:
    campaign = make_campaign()
    online, _ = make_device("online")
    online.hardware = {"kind": "cuda"}
    online.save(update_fields=["hardware"])
    make_device("offline")
    hot_state().mark_seen([online.pk])
    Standing.objects.create(volunteer=make_user("suspect"), state=Standing.State.QUARANTINED)
    Standing.objects.create(volunteer=make_user("fine"), state=Standing.State.GOOD)
    name = SliceAssignment.objects.get(campaign=campaign).aggregator.name

    samples = scrape(Client())

    assert value(samples, "crowdtrain_agents_online") == 1
    assert value(samples, "crowdtrain_agents_online_by_kind", kind="cuda") == 1
    assert (
        value(samples, "crowdtrain_volunteers_quarantined")
        == (Standing.objects.filter(state=Standing.State.QUARANTINED).count())
        == 1
    )
    assert value(samples, "crowdtrain_aggregators_connected") == 1
    assert value(samples, "crowdtrain_aggregator_connected", aggregator=name) == 1


def test_a_firing_alert_is_a_gauge_of_one_with_its_campaign() -> None:
    campaign = make_campaign()
    SliceAssignment.objects.filter(campaign=campaign).update(ready=False)

    samples = scrape(Client())

    assert value(
        samples, "crowdtrain_alert", code="campaign_waiting_for_aggregators", campaign=str(campaign.pk),
        severity="critical",
    ) == 1  # fmt: skip


def test_the_latency_histograms_count_lease_requests_and_commits() -> None:
    before = scrape(Client())
    campaign = make_campaign()
    device, _ = make_device()

    work_until_committed(campaign, [device.pk], 2)
    after = scrape(Client())

    commits = (value(after, "crowdtrain_step_commit_seconds_count") or 0) - (
        value(before, "crowdtrain_step_commit_seconds_count") or 0
    )
    assert commits == Step.objects.filter(campaign=campaign).count() == 2
    assert value(after, "crowdtrain_lease_request_seconds_bucket", le="+Inf") is not None


def test_only_aggregators_holding_slices_of_running_campaigns_count_for_the_silent_alert() -> None:
    campaign = make_campaign()
    holder = SliceAssignment.objects.get(campaign=campaign).aggregator.name
    Aggregator.objects.create(name="spare", token_hash="spare-token-hash")  # a token whose aggregator never ran

    running = scrape(Client())
    campaign.state = campaign.State.PAUSED
    campaign.save(update_fields=["state"])
    paused = scrape(Client())

    assert value(running, "crowdtrain_aggregator_running_slices", aggregator=holder) == 1
    assert value(running, "crowdtrain_aggregator_running_slices", aggregator="spare") == 0
    assert value(running, "crowdtrain_aggregator_connected", aggregator="spare") == 0
    assert value(paused, "crowdtrain_aggregator_running_slices", aggregator=holder) == 0


def test_the_referees_rulings_and_kept_versions_are_counted() -> None:
    from datetime import timedelta

    from django.utils import timezone

    from crowdtrain.verification.models import Check, KeptVersion

    campaign = make_campaign()
    volunteer = make_user("ruled")
    now = timezone.now()
    for lease_id, ruled_at in ((1, now - timedelta(minutes=5)), (2, now - timedelta(hours=2)), (3, None)):
        Check.objects.create(campaign=campaign, lease_id=lease_id, volunteer=volunteer, base_version=0,
                             ranges=[[0, 0, 0, 4]], num_samples=4, refereed_at=ruled_at)  # fmt: skip
    KeptVersion.objects.create(campaign=campaign, version=0, name="referee/x")

    samples = scrape(Client())

    assert value(samples, "crowdtrain_referee_rulings_last_hour") == 1
    assert value(samples, "crowdtrain_referee_kept_versions") == KeptVersion.objects.count() == 1
    assert value(samples, "crowdtrain_verification_checks", state="referee") == 0
