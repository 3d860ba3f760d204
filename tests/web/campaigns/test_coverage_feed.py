"""The shard coverage feed: each state's samples per shard from the epoch's leases and checks, with public names."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from crowdtrain.accounts.models import Device, Profile
from crowdtrain.campaigns.models import Campaign, Step
from crowdtrain.ops import coverage
from crowdtrain.scheduler import endings, leasing
from crowdtrain.scheduler.hotstate import hot_state
from crowdtrain.scheduler.models import Lease
from crowdtrain.verification.models import Check
from crowdtrain_agent.protocol import Lease as LeaseMessage
from tests.factories import make_campaign, make_device, make_volunteer, work_until_committed

pytestmark = pytest.mark.django_db

EPOCH = 1


@pytest.fixture
def campaign() -> Campaign:
    campaign = make_campaign()  # 100 samples in shards of 30, 30, 30 and 10
    Campaign.objects.filter(pk=campaign.pk).update(epoch=EPOCH, cursor=40)
    return Campaign.objects.select_related("dataset").get(pk=campaign.pk)


def _volunteer(name: str, *, display_name: str = "", anonymous: bool = False) -> Device:
    user = make_volunteer(name)
    Profile.objects.filter(user=user).update(display_name=display_name, anonymous=anonymous)
    return Device.issue(user, f"{name}'s laptop")[0]


def _lease(
    campaign: Campaign, device: Device, ranges: list[list[int]], state: str = "accepted", step: Step | None = None
) -> Lease:
    return Lease.objects.create(
        campaign=campaign, device=device, base_version=0, ranges=ranges, epoch=ranges[0][0],
        num_samples=sum(r[3] for r in ranges), state=state, step=step, deadline=timezone.now(),
    )  # fmt: skip


def _check(lease: Lease, state: str) -> None:
    Check.objects.create(
        campaign=lease.campaign, lease_id=lease.pk, volunteer=lease.device.owner, base_version=0,
        ranges=lease.ranges, num_samples=lease.num_samples, state=state,
    )  # fmt: skip


def _feed(campaign: Campaign, client: Client | None = None) -> dict[str, Any]:
    response = (client or Client()).get(f"/api/campaigns/{campaign.pk}/coverage")
    assert response.status_code == 200, response.content
    return response.json()


def _cell(feed: dict[str, Any], shard: int) -> dict[str, Any]:
    return next(c for c in feed["cells"] if c["first_shard"] <= shard <= c["last_shard"])


def _counts(feed: dict[str, Any], cell: dict[str, Any]) -> dict[str, int]:
    """A cell's nonzero counts by state (the feed lists them in the order of its "states")."""
    return {state: n for state, n in zip(feed["states"], cell["counts"], strict=True) if n}


def test_it_counts_every_sample_of_the_epoch_once_in_its_most_advanced_state(campaign: Campaign) -> None:
    alice = _volunteer("alice", display_name="Alice")
    bob = _volunteer("bob", display_name="Bobby Tables", anonymous=True)
    carol = _volunteer("carol", display_name="Carol")
    step = Step.objects.create(campaign=campaign, index=0, num_samples=32, loss_sum=0.0)
    # Shard 0, samples 0..24: one lease in each state, and an expired one under the verified and done ones.
    _check(_lease(campaign, alice, [[EPOCH, 0, 0, 5]], step=step), Check.State.PASSED)
    _check(_lease(campaign, bob, [[EPOCH, 0, 5, 5]], step=step), Check.State.OPEN)
    _lease(campaign, carol, [[EPOCH, 0, 10, 4]])
    _lease(campaign, carol, [[EPOCH, 0, 14, 3]], state="active")
    _lease(campaign, carol, [[EPOCH, 0, 17, 2]], state="rejected")
    _lease(campaign, carol, [[EPOCH, 0, 19, 3]], state="expired")
    _lease(campaign, carol, [[EPOCH, 0, 22, 1]], state="released")
    _lease(campaign, carol, [[EPOCH, 0, 0, 10]], state="expired")
    # Begun at the end of the last epoch, it reaches into this one: samples 23..24 of shard 0.
    _lease(campaign, carol, [[EPOCH - 1, 3, 5, 5], [EPOCH, 0, 23, 2]], state="active")
    # Shard 1: a committed lease whose check failed, half covered by a committed one that did not.
    _check(_lease(campaign, carol, [[EPOCH, 1, 0, 6]], step=step), Check.State.FAILED)
    _lease(campaign, alice, [[EPOCH, 1, 3, 6]], step=step)

    feed = _feed(campaign)

    assert [_counts(feed, _cell(feed, s)) for s in range(4)] == [
        {"verified": 5, "done": 5, "accepted": 4, "leased": 5, "rejected": 2, "returned": 4, "untouched": 5},
        {"done": 6, "rejected": 3, "untouched": 21},
        {"untouched": 30},
        {"untouched": 10},
    ]
    assert feed["totals"] == {
        "verified": 5, "done": 11, "accepted": 4, "leased": 5, "rejected": 5, "returned": 4, "untouched": 66,
    }  # fmt: skip
    assert (feed["epoch"], feed["touched"], feed["num_samples"], feed["num_shards"]) == (EPOCH, True, 100, 4)
    assert feed["shards_per_cell"] == 1 and [c["samples"] for c in feed["cells"]] == [30, 30, 30, 10]
    assert sorted((v["name"], v["samples"]) for v in _cell(feed, 0)["volunteers"]) == [
        ("Alice", 5), ("Anonymous volunteer", 5),
    ]  # fmt: skip
    assert _cell(feed, 1)["volunteers"] == [{"name": "Alice", "samples": 6}]  # carol's work there was rejected
    assert _cell(feed, 2)["volunteers"] == [] and _cell(feed, 1)["state"] == "untouched"


def test_leases_of_the_previous_epoch_are_left_out(campaign: Campaign) -> None:
    alice = _volunteer("alice", display_name="Alice")
    old = Step.objects.create(campaign=campaign, index=0, num_samples=60, loss_sum=0.0)
    _lease(campaign, alice, [[EPOCH - 1, 0, 0, 30], [EPOCH - 1, 1, 0, 30]], step=old)
    _lease(campaign, alice, [[EPOCH - 1, 2, 0, 30]], state="active")
    _lease(campaign, alice, [[EPOCH, 3, 0, 4]], state="active")

    feed = _feed(campaign)

    assert feed["totals"]["untouched"] == 96 and feed["totals"]["leased"] == 4
    assert all(not cell["volunteers"] for cell in feed["cells"])


def test_it_names_volunteers_by_their_public_name_only(campaign: Campaign) -> None:
    step = Step.objects.create(campaign=campaign, index=0, num_samples=32, loss_sum=0.0)
    hidden = _volunteer("hidden", display_name="Secret Sam", anonymous=True)
    shy = _volunteer("shy", anonymous=True)
    plain = _volunteer("plain")
    _lease(campaign, hidden, [[EPOCH, 0, 0, 10]], step=step)
    _lease(campaign, shy, [[EPOCH, 0, 10, 5]], step=step)
    _lease(campaign, plain, [[EPOCH, 0, 15, 1]], step=step)

    response = Client().get(f"/api/campaigns/{campaign.pk}/coverage")

    body = response.content.decode()
    assert "@example.org" not in body and "Secret Sam" not in body and "hidden" not in body
    # The two anonymous volunteers make one entry: the map does not count who hides.
    assert response.json()["cells"][0]["volunteers"] == [
        {"name": "Anonymous volunteer", "samples": 15},
        {"name": f"Volunteer {plain.owner_id}", "samples": 1},
    ]


def test_it_says_nothing_happened_yet_in_a_fresh_epoch(campaign: Campaign) -> None:
    feed = _feed(campaign)

    assert feed["touched"] is False and feed["totals"]["untouched"] == 100
    assert [c["state"] for c in feed["cells"]] == ["untouched"] * 4


def test_a_dataset_with_more_shards_than_cells_is_drawn_in_groups_of_shards(
    campaign: Campaign, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(coverage, "MAX_CELLS", 3)
    _lease(campaign, _volunteer("alice"), [[EPOCH, 1, 0, 30], [EPOCH, 2, 0, 5]], state="active")

    feed = _feed(campaign)

    assert feed["shards_per_cell"] == 2
    assert [(c["first_shard"], c["last_shard"], c["samples"]) for c in feed["cells"]] == [(0, 1, 60), (2, 3, 40)]
    assert [_counts(feed, c) for c in feed["cells"]] == [
        {"leased": 30, "untouched": 30},
        {"leased": 5, "untouched": 35},
    ]


def test_the_feed_is_cached_for_a_few_seconds(campaign: Campaign) -> None:
    before = _feed(campaign)
    _lease(campaign, _volunteer("alice"), [[EPOCH, 0, 0, 30]], state="active")

    again = _feed(campaign)

    assert again == before
    assert coverage.compute_coverage(campaign)["totals"]["leased"] == 30


def test_the_map_costs_the_same_few_queries_whatever_the_number_of_leases(
    campaign: Campaign, django_assert_max_num_queries: Any
) -> None:
    step = Step.objects.create(campaign=campaign, index=0, num_samples=32, loss_sum=0.0)
    devices = [_volunteer(f"v{i}") for i in range(5)]
    for i in range(60):
        _lease(campaign, devices[i % 5], [[EPOCH, i % 3, i % 30, 1]], step=step if i % 2 else None)
    coverage.compute_coverage(campaign)  # the shard table is cached per process

    with django_assert_max_num_queries(2):
        feed = coverage.compute_coverage(campaign)

    assert sum(feed["totals"].values()) == 100


def test_it_agrees_with_the_scheduler_on_leases_it_just_issued_and_released(campaign: Campaign) -> None:
    Campaign.objects.filter(pk=campaign.pk).update(epoch=0, cursor=0)
    campaign.refresh_from_db()
    device = make_device("alice")[0]
    work_until_committed(campaign, [device.pk], steps=1)
    out = leasing.request_lease(device.pk, campaign.pk, None)
    released = leasing.request_lease(device.pk, campaign.pk, None)
    assert isinstance(out, LeaseMessage) and isinstance(released, LeaseMessage)
    assert endings.release_lease(device.pk, released.lease_id)
    campaign.refresh_from_db()

    feed = coverage.compute_coverage(campaign)

    live = hot_state().snapshot(campaign.hot_key.hex)["leases"]
    assert feed["totals"]["leased"] == sum(lease["n"] for lease in live if lease["st"] == "active")
    assert feed["totals"]["leased"] == out.num_samples
    assert feed["totals"]["done"] == sum(campaign.steps.values_list("num_samples", flat=True)) > 0
    assert feed["totals"]["returned"] == released.num_samples
