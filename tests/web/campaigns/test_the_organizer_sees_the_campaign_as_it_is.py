"""The organizer's campaign page says what the campaign really does (not just RUNNING), how far it is, when
it will end, who trains it, and draws week-long curves from a bounded number of points; Finish asks first."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.core.cache import cache
from django.test import Client
from django.utils import timezone

from crowdtrain.accounts.models import ANONYMOUS_NAME, Profile
from crowdtrain.campaigns.lifecycle import apply_move
from crowdtrain.campaigns.models import Campaign, Step, ValidationResult
from crowdtrain.ops import campaign_monitor as monitor
from crowdtrain.ops import health
from crowdtrain.scheduler import leasing
from crowdtrain.scheduler.models import Aggregator, Lease, SliceAssignment
from tests.factories import commit_leases, logged_in, make_admin, make_campaign, make_device, make_organizer, make_user

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _no_cached_series() -> None:
    cache.clear()


def owned(**fields: Any) -> tuple[Campaign, Client]:
    campaign = make_campaign(**fields)
    olga = make_organizer("olga")
    Campaign.objects.filter(pk=campaign.pk).update(owner=olga)
    client = logged_in(olga)
    return Campaign.objects.get(pk=campaign.pk), client


def feed(client: Client, campaign: Campaign) -> dict[str, Any]:
    response = client.get(f"/api/campaigns/{campaign.pk}/monitor")
    assert response.status_code == 200, response.content
    return response.json()


def add_steps(campaign: Campaign, losses: list[float], *, every_s: float, end: Any = None, samples: int = 8) -> None:
    end = end or timezone.now()
    start = end - timedelta(seconds=every_s * (len(losses) - 1))
    Step.objects.bulk_create(
        Step(
            campaign=campaign,
            index=i,
            num_samples=samples,
            loss_sum=loss * samples,
            committed_at=start + timedelta(seconds=every_s * i),
        )
        for i, loss in enumerate(losses)
    )
    Campaign.objects.filter(pk=campaign.pk).update(committed_steps=len(losses), version=len(losses))
    campaign.refresh_from_db()


def active_lease(campaign: Campaign, device_id: int, samples: int = 4) -> Lease:
    now = timezone.now()
    return Lease.objects.create(
        campaign=campaign,
        device_id=device_id,
        base_version=campaign.version,
        ranges=[[0, 0, 0, samples]],
        num_samples=samples,
        issued_at=now - timedelta(seconds=30),
        deadline=now + timedelta(seconds=90),
    )


def test_a_running_campaign_without_aggregators_says_it_waits_for_them() -> None:
    campaign, client = owned()
    SliceAssignment.objects.filter(campaign=campaign).delete()

    condition = feed(client, campaign)["condition"]

    assert condition["code"] == "waiting_for_aggregators"
    assert condition["title"] == "Waiting for aggregators: 0 of 1 slice ready"
    assert "create_backbone_token" in condition["what_to_do"]


def test_a_silent_aggregator_is_a_stall_the_page_names() -> None:
    campaign, client = owned()
    Aggregator.objects.filter(slices__campaign=campaign).update(connected=False)

    condition = feed(client, campaign)["condition"]

    assert condition["code"] == "aggregator_silent" and condition["level"] == "critical"
    assert f"agg-{campaign.pk}-0" in condition["text"]


def test_nobody_working_is_waiting_for_volunteers_and_a_lease_out_is_training() -> None:
    campaign, client = owned()
    assert feed(client, campaign)["condition"]["code"] == "waiting_for_volunteers"

    device, _ = make_device("vera")
    active_lease(campaign, device.pk)
    now = feed(client, campaign)

    assert now["condition"]["code"] == "training"
    assert now["condition"]["text"] == "1 lease out; the first step is being computed."
    assert now["leases"]["count_text"] == "1 lease"
    row = now["leases"]["rows"][0]
    assert row["samples"] == 4 and row["deadline_text"] == "1\xa0minute"


def test_a_campaign_with_no_step_for_too_long_is_stalled_counted_from_its_resume(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    campaign, client = owned()
    device, _ = make_device("vera")
    long_ago = timezone.now() - timedelta(minutes=settings.CROWDTRAIN_STALLED_AFTER_MIN + 5)
    add_steps(campaign, [3.0, 2.0], every_s=10, end=long_ago)
    Campaign.objects.filter(pk=campaign.pk).update(running_since=long_ago)
    # Nobody works on it: it waits for volunteers, which is no emergency (issue 34).
    assert feed(client, campaign)["condition"]["code"] == "waiting_for_volunteers"

    leasing.request_lease(device.pk, campaign.pk, None)  # a volunteer holds a lease, and still no step comes
    assert feed(client, campaign)["condition"]["code"] == "stalled"

    # Paused for an hour, resumed a minute ago: not stalled, whatever the age of its last step.
    Campaign.objects.filter(pk=campaign.pk).update(running_since=timezone.now() - timedelta(minutes=1))
    assert [a.code for a in health.evaluate_campaign(campaign.pk)] == []
    assert feed(client, campaign)["condition"]["code"] == "training"


def test_progress_has_elapsed_time_and_an_estimate_from_the_recent_pace() -> None:
    campaign, client = owned(max_steps=100)
    Campaign.objects.filter(pk=campaign.pk).update(started_at=timezone.now() - timedelta(hours=2))
    device, _ = make_device("vera")
    active_lease(campaign, device.pk)
    add_steps(campaign, [3.0] * 40, every_s=10.0, samples=8)  # 0.1 steps/s, 0.8 samples/s

    p = feed(client, campaign)["progress"]

    assert p["committed_steps"] == 40 and p["fraction"] == pytest.approx(0.4)
    assert p["eta_s"] == pytest.approx(60 / 0.1, rel=1e-3)  # 60 steps left at 0.1 steps/s
    assert p["eta_text"].startswith("about 10\xa0minutes left")
    assert p["samples_per_s"] == pytest.approx(0.8, rel=1e-3)
    assert p["elapsed_text"].startswith("2\xa0hours")
    assert p["train_loss"] == pytest.approx(3.0) and p["samples"] == 320


def test_after_finish_there_is_no_live_rate_only_the_average_over_the_run() -> None:
    campaign, client = owned(max_steps=3)
    Campaign.objects.filter(pk=campaign.pk).update(started_at=timezone.now() - timedelta(seconds=100))
    add_steps(campaign, [3.0, 2.0, 1.0], every_s=5.0, samples=10)
    apply_move(campaign.pk, "finish", None)
    campaign.refresh_from_db()

    now = feed(client, campaign)
    page = client.get(f"/campaigns/{campaign.pk}/").content.decode()

    assert now["progress"]["samples_per_s"] is None and now["progress"]["eta_text"] == ""
    assert now["progress"]["average_samples_per_s"] == pytest.approx(30 / 100, rel=0.05)
    assert now["condition"]["code"] == "finished"
    assert "after 3 steps: it made its 3 steps" in now["condition"]["text"]
    assert "Samples/s now" not in page and "Average samples/s" in page


@pytest.mark.parametrize(
    ("val_loss", "why"),
    [(0.4, "its validation loss reached 0.400 (target 0.5)"), (0.9, "finished by hand")],
)
def test_a_finished_campaign_says_why_it_finished(val_loss: float, why: str) -> None:
    campaign, client = owned(max_steps=None, target_val_loss=0.5)
    add_steps(campaign, [1.0], every_s=1.0)
    ValidationResult.objects.create(campaign=campaign, version=1, loss=val_loss, num_samples=10)
    Campaign.objects.filter(pk=campaign.pk).update(state=Campaign.State.FINISHED, finished_at=timezone.now())

    assert why in feed(client, campaign)["condition"]["text"]


def test_a_paused_campaign_counts_its_leases_in_words_that_agree() -> None:
    campaign, client = owned()
    device, _ = make_device("vera")
    for _ in range(2):
        active_lease(campaign, device.pk)
    apply_move(campaign.pk, "pause", None)

    condition = feed(client, campaign)["condition"]

    assert condition["code"] == "paused"
    assert "2 leases still out: each counts only if its agent reports it before its deadline" in condition["text"]


def test_a_week_of_steps_is_drawn_from_a_bounded_number_of_weighted_points() -> None:
    campaign, client = owned()
    steps = 3 * monitor.MAX_POINTS + 7
    losses = [10.0 - 9.0 * i / steps for i in range(steps)]
    add_steps(campaign, losses, every_s=600.0)  # three weeks of a step every 10 minutes
    for version in range(10, steps + 1, 10):
        ValidationResult.objects.create(campaign=campaign, version=version, loss=losses[version - 1], num_samples=4)

    series = feed(client, campaign)["series"]

    width = series["steps_per_point"]
    assert width == 4 and len(series["step"]) == len(series["loss"]) == len(series["time"]) <= monitor.MAX_POINTS
    assert series["step"][0] == width and series["step"][-1] == steps  # numbered as the versions they made
    assert series["loss"][0] == pytest.approx(sum(losses[:width]) / width)
    assert series["samples_per_s"][0] is None  # no earlier commit to measure the first point from
    assert series["samples_per_s"][1] == pytest.approx(width * 8 / (width * 600.0))
    # further on, the rate averages the last RATE_WINDOW points: still 8 samples per 600 s here
    assert series["samples_per_s"][50] == pytest.approx(8 / 600.0)
    assert len(series["val_step"]) <= monitor.MAX_POINTS + 1 and series["val_step"][-1] == steps - steps % 10
    assert series["time"] == sorted(series["time"])


def test_contributors_are_listed_by_public_name_with_their_share(
    django_capture_on_commit_callbacks: Callable[..., Any],
) -> None:
    campaign, client = owned(target_batch_size=8, microbatch_size=4)
    alice, _ = make_device("alice")
    bob, _ = make_device("bob")
    Profile.objects.filter(user=alice.owner).update(display_name="Alice")
    Profile.objects.filter(user=bob.owner).update(anonymous=True)
    with django_capture_on_commit_callbacks(execute=True):
        commit_leases(campaign, [alice.pk, alice.pk, bob.pk], leases=6)

    people = feed(client, campaign)["contributors"]

    assert people["count"] == 2 and people["count_text"] == "2 contributors"
    assert [row["name"] for row in people["top"]] == ["Alice", ANONYMOUS_NAME]
    assert [row["share_text"] for row in people["top"]] == ["67%", "33%"]
    assert sum(row["share"] for row in people["top"]) == pytest.approx(1.0)
    assert "bob" not in str(people) and "@" not in str(people)


@pytest.mark.parametrize("who", ["other organizer", "volunteer", "anonymous"])
def test_the_feed_is_for_whoever_manages_the_campaign(who: str) -> None:
    campaign, _ = owned()
    client = Client()
    if who != "anonymous":
        client.force_login(make_organizer("otto") if who == "other organizer" else make_user("vera"))

    response = client.get(f"/api/campaigns/{campaign.pk}/monitor")

    assert response.status_code == 404 and response.json() == {"error": f"no campaign {campaign.pk} that you manage"}
    admin = logged_in(make_admin())
    assert admin.get(f"/api/campaigns/{campaign.pk}/monitor").status_code == 200


@pytest.mark.parametrize("action", ["finish", "archive"])
def test_moves_that_cannot_be_undone_ask_first(action: str) -> None:
    campaign, client = owned()
    if action == "archive":
        Campaign.objects.filter(pk=campaign.pk).update(state=Campaign.State.FINISHED)
    before = Campaign.objects.get(pk=campaign.pk).state

    asked = client.post(f"/campaigns/{campaign.pk}/lifecycle", {"action": action})

    assert asked.status_code == 200 and "This cannot be undone." in asked.content.decode()
    assert f'data-testid="confirm-{action}"' in asked.content.decode()
    assert Campaign.objects.get(pk=campaign.pk).state == before
    client.post(f"/campaigns/{campaign.pk}/lifecycle", {"action": action, "confirmed": "yes"})
    assert Campaign.objects.get(pk=campaign.pk).state == ("finished" if action == "finish" else "archived")


def test_the_lifecycle_stamps_its_times() -> None:
    campaign, _ = owned()
    Campaign.objects.filter(pk=campaign.pk).update(state=Campaign.State.DRAFT)

    started = apply_move(campaign.pk, "start", None)
    apply_move(campaign.pk, "pause", None)
    resumed = apply_move(campaign.pk, "resume", None)
    finished = apply_move(campaign.pk, "finish", None)

    assert started.started_at is not None and resumed.started_at == started.started_at
    assert resumed.running_since is not None and resumed.running_since > started.running_since
    assert finished.finished_at is not None and finished.finished_at >= resumed.running_since


def test_the_page_renders_the_same_numbers_the_feed_sends() -> None:
    campaign, client = owned(max_steps=10)
    add_steps(campaign, [2.5, 1.5], every_s=5.0)
    device, _ = make_device("vera")
    active_lease(campaign, device.pk)

    page = client.get(f"/campaigns/{campaign.pk}/").content.decode()

    assert 'data-testid="condition" data-code="training"' in page
    assert '<dd data-stat="train_loss">1.500</dd>' in page
    assert '<dd data-stat="active_leases">1</dd>' in page
    assert 'id="campaign-live"' in page and "build/charts.js" in page


def test_the_throughput_curve_is_a_moving_average_not_each_steps_burst() -> None:
    campaign, client = owned()
    start = timezone.now() - timedelta(hours=1)
    gaps = [1.0 if i % 2 else 9.0 for i in range(30)]  # bursts: steps 1 s and 9 s apart, in turn
    at = [start + timedelta(seconds=sum(gaps[:i])) for i in range(30)]
    Step.objects.bulk_create(
        Step(campaign=campaign, index=i, num_samples=8, loss_sum=8.0, committed_at=at[i]) for i in range(30)
    )
    Campaign.objects.filter(pk=campaign.pk).update(committed_steps=30, version=30)
    campaign.refresh_from_db()

    rates = feed(client, campaign)["series"]["samples_per_s"]

    window = monitor.RATE_WINDOW
    assert window % 2 == 0
    # Every full window holds as many 1 s gaps as 9 s ones: 8 samples per step over 5 s on average.
    assert rates[window:] == pytest.approx([8 / 5.0] * (30 - window))


def test_the_public_feed_and_the_campaign_list_count_contributors_as_the_organizer_page_does(
    django_capture_on_commit_callbacks: Callable[..., Any],
) -> None:
    campaign, client = owned(target_batch_size=8, microbatch_size=4)
    alice, _ = make_device("alice")
    bob, _ = make_device("bob")
    with django_capture_on_commit_callbacks(execute=True):
        commit_leases(campaign, [alice.pk, alice.pk, bob.pk], leases=6)

    public = Client().get(f"/api/campaigns/{campaign.pk}/progress").json()
    listing = Client().get("/").content.decode()

    assert public["contributors"] == feed(client, campaign)["contributors"]["count"] == 2
    assert '<b data-field="contributors">2</b> contributors' in listing


def test_the_public_feed_and_the_list_draw_a_long_run_from_the_bounded_series() -> None:
    campaign, _ = owned()
    steps = 2 * monitor.MAX_POINTS + 3
    add_steps(campaign, [5.0 - 4.0 * i / steps for i in range(steps)], every_s=60.0)

    public = Client().get(f"/api/campaigns/{campaign.pk}/progress").json()
    listing = Client().get("/").content.decode()

    assert public["steps_per_point"] == 3 and len(public["losses"]) <= monitor.MAX_POINTS
    assert public["series"]["step"][-1] == steps and public["samples"] == steps * 8
    assert f'id="campaign-series-{campaign.pk}"' in listing and 'data-testid="campaign-list-chart"' in listing
