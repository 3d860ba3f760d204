"""The daily stats export: every volunteer's and team's credit as the ledger has it, public names only, served at
/stats/stats.json once the first export has run."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.core.files.storage import default_storage
from django.test import Client
from django.utils import timezone

from crowdtrain.accounts.models import ANONYMOUS_NAME, Device, Profile, Team
from crowdtrain.campaigns.models import Campaign
from crowdtrain.credit import export, tasks
from crowdtrain.credit.models import FLOPS_PER_CREDIT, CreditEntry
from crowdtrain.scheduler import backbone
from crowdtrain.scheduler.models import Lease
from crowdtrain_agent.models import get_model
from crowdtrain_agent.protocol import SliceReady
from tests.factories import make_campaign, make_device, make_volunteer, work_until_committed

pytestmark = pytest.mark.django_db


def _volunteer_device(name: str) -> Device:
    """A volunteer as sign-up leaves them (username and e-mail address), with one device."""
    make_volunteer(name)
    return make_device(name)[0]


def _exported() -> dict[str, Any]:
    export.export_stats()
    with default_storage.open(export.STATS_NAME, "rb") as stored:
        return json.load(stored)


def _committed_credit(campaign: Campaign, device: Device) -> float:
    """Credit for the device's leases whose step is committed now, from the leases, not the ledger."""
    per_sample = get_model(campaign.architecture).flops_per_sample(campaign.model_config)
    samples = sum(Lease.objects.filter(device=device, step__isnull=False).values_list("num_samples", flat=True))
    return samples * per_sample / FLOPS_PER_CREDIT


def test_totals_match_the_ledger_after_a_rollback_took_credit_back() -> None:
    campaign = make_campaign(target_batch_size=8, microbatch_size=4)
    alice, bob = _volunteer_device("alice"), _volunteer_device("bob")
    team = Team.objects.create(name="Night Owls")
    Profile.objects.filter(user__in=[alice.owner, bob.owner]).update(team=team)
    work_until_committed(campaign, [alice.pk, bob.pk], steps=3)
    backbone.restore_campaign(campaign.pk, 0)  # every step undone: all of that credit is reversed
    for s in campaign.slices.all():
        backbone.slice_ready(s.aggregator_id, SliceReady(campaign_id=campaign.pk, slice_index=s.index, version=0))
    work_until_committed(campaign, [alice.pk], steps=1)  # only alice's redone work counts

    doc = _exported()

    users = {u["id"]: u for u in doc["users"]}
    assert CreditEntry.objects.filter(kind=CreditEntry.Kind.REVERSAL, volunteer=bob.owner).exists()
    assert users[alice.owner_id]["total_credit"] == pytest.approx(_committed_credit(campaign, alice), rel=1e-6)
    assert users[alice.owner_id]["samples"] == 8 and users[alice.owner_id]["team_id"] == team.pk
    assert users[bob.owner_id]["total_credit"] == 0.0 and users[bob.owner_id]["samples"] == 0
    (owls,) = doc["teams"]
    assert (owls["id"], owls["name"], owls["members"]) == (team.pk, "Night Owls", 2)
    assert owls["total_credit"] == pytest.approx(_committed_credit(campaign, alice), rel=1e-6)


def test_recent_credit_per_day_counts_only_the_last_seven_days() -> None:
    campaign = make_campaign(target_batch_size=8, microbatch_size=4)
    alice = _volunteer_device("alice")
    work_until_committed(campaign, [alice.pk], steps=2)
    total = _committed_credit(campaign, alice)
    old = CreditEntry.objects.order_by("pk").first()
    assert old is not None
    CreditEntry.objects.filter(pk=old.pk).update(created_at=timezone.now() - timedelta(days=8))

    (user,) = _exported()["users"]

    assert user["total_credit"] == pytest.approx(total, rel=1e-6)
    assert user["recent_credit_per_day"] == pytest.approx((total - old.credit) / 7, rel=1e-5)
    assert user["recent_credit_per_day"] < total / 7


def test_it_shows_public_names_and_never_an_email_address_or_username() -> None:
    campaign = make_campaign(target_batch_size=8, microbatch_size=4)
    named, unnamed = _volunteer_device("zelda.quux"), _volunteer_device("yorick.plumb")
    Profile.objects.filter(user=named.owner).update(display_name="Zelda Q")
    work_until_committed(campaign, [named.pk, unnamed.pk], steps=2)

    export.export_stats()

    with default_storage.open(export.STATS_NAME, "rb") as stored:
        raw = stored.read().decode()
    names = {u["id"]: u["name"] for u in json.loads(raw)["users"]}
    assert names == {named.owner_id: "Zelda Q", unnamed.owner_id: f"Volunteer {unnamed.owner_id}"}
    for secret in ("zelda.quux", "yorick.plumb", "@example.org"):
        assert secret not in raw


def test_an_anonymous_volunteer_appears_only_as_anonymous() -> None:
    campaign = make_campaign(target_batch_size=8, microbatch_size=4)
    shy = _volunteer_device("shy")
    team = Team.objects.create(name="Quiet Ones")
    Profile.objects.filter(user=shy.owner).update(display_name="Secret Sam", anonymous=True, team=team)
    work_until_committed(campaign, [shy.pk], steps=1)

    first, second = _exported(), _exported()

    (user,) = first["users"]
    assert user["name"] == ANONYMOUS_NAME and user["team_id"] is None
    assert isinstance(user["id"], str) and user["id"].startswith("anon-")
    assert second["users"][0]["id"] == user["id"]  # stable, so stats sites can follow them over time
    assert "Secret Sam" not in json.dumps(first)
    assert first["teams"][0]["total_credit"] == pytest.approx(user["total_credit"])  # the team keeps the credit


def test_the_url_serves_the_latest_export_daily() -> None:
    campaign = make_campaign(target_batch_size=8, microbatch_size=4)
    alice = _volunteer_device("alice")
    work_until_committed(campaign, [alice.pk], steps=1)
    tasks.export_stats()
    work_until_committed(campaign, [alice.pk], steps=2)

    tasks.export_stats()  # the next day's run replaces the document at the same address
    response = Client().get("/stats/stats.json")

    assert response.status_code == 200 and response["Content-Type"] == "application/json"
    doc = json.loads(b"".join(response.streaming_content))  # type: ignore[attr-defined]
    assert doc["users"][0]["samples"] == 16 and doc["credit"]["flops_per_credit"] == FLOPS_PER_CREDIT
    assert "GFLOP" in doc["credit"]["unit"] and doc["generated_at"]
    assert default_storage.listdir("stats")[1] == ["stats.json"]
    daily = [e for e in settings.CELERY_BEAT_SCHEDULE.values() if e["task"] == "crowdtrain.credit.tasks.export_stats"]
    assert [e["schedule"] for e in daily] == [86400.0]


def test_before_the_first_export_the_url_says_when_it_comes() -> None:
    response = Client().get("/stats/stats.json")

    assert response.status_code == 404
    assert response.json() == {"error": "the first export has not run yet; it runs daily"}
