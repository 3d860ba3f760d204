"""Local-mode (DiLoCo) campaigns: what their leases carry, who may get them, and the settings refused.

A local lease names the inner optimizer with its learning rate already on the
campaign's schedule for the lease's base version. An agent of 2.2 would
upload a gradient where a pseudo-gradient is meant, so it is told to upgrade
and the lease goes back at once. At staleness 1 a lease of the next round
goes out while the last round is still open, and names the version to rebase
onto (2.4): an agent of 2.3 would upload a movement from the wrong version, so
it too is told to upgrade.
"""

from __future__ import annotations

import pytest
from asgiref.sync import sync_to_async
from django.test import override_settings

from crowdtrain.campaigns.setup import CampaignConfigError
from crowdtrain.scheduler.models import Lease as LeaseRow
from crowdtrain_agent.protocol import Lease, LeaseRequest
from tests.factories import make_campaign

from .conftest import Connect, greeted_agent, lease_asked_by_an_agent_of_minor, receive, send

pytestmark = pytest.mark.django_db(transaction=True)

LOCAL = {
    "training_mode": "local",
    "inner_optimizer": "adamw",
    "inner_lr": 4e-3,
    "inner_weight_decay": 0.1,
    "check_fraction": 0.0,
    "staleness": 0,
    "optimizer": {"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True, "warmup_steps": 4},
    "max_steps": 100,
}


async def test_a_local_lease_names_the_inner_optimizer_on_the_campaigns_schedule(connect: Connect) -> None:
    await sync_to_async(make_campaign)(**LOCAL)
    agent = await greeted_agent(connect)

    await send(agent, LeaseRequest())
    lease = await receive(agent)

    assert isinstance(lease, Lease) and lease.mode == "local" and lease.inner is not None
    assert (lease.inner.name, lease.inner.weight_decay) == ("adamw", 0.1)
    # Version 0 is the first of 4 warmup steps: a quarter of the inner peak rate.
    assert lease.inner.lr == pytest.approx(4e-3 / 4)


@override_settings(CROWDTRAIN_LEASE_TARGET_S=15.0)
async def test_a_local_lease_is_whole_inner_batches_and_names_their_size(connect: Connect) -> None:
    await sync_to_async(make_campaign)(**LOCAL, inner_batch_size=8)  # microbatches of 4, rounds of 32
    agent = await greeted_agent(connect)

    # 15 s (the lease target) of this speed is 12 samples: three microbatches, but one and a half inner batches.
    await send(agent, LeaseRequest(samples_per_s=0.8))
    lease = await receive(agent)

    assert isinstance(lease, Lease) and (lease.microbatch_size, lease.inner_batch_size) == (4, 8)
    assert lease.num_samples == 8


@override_settings(CROWDTRAIN_MAX_LEASE_SAMPLES=20)
async def test_the_largest_lease_is_cut_to_whole_inner_batches(connect: Connect) -> None:
    await sync_to_async(make_campaign)(**LOCAL, inner_batch_size=8)
    agent = await greeted_agent(connect)

    await send(agent, LeaseRequest(samples_per_s=1e6))  # would take the whole round of 32, but 20 is the most
    lease = await receive(agent)

    assert isinstance(lease, Lease) and lease.num_samples == 16


async def test_a_sync_lease_names_no_inner_optimizer(connect: Connect) -> None:
    await sync_to_async(make_campaign)()
    agent = await greeted_agent(connect)

    await send(agent, LeaseRequest())
    lease = await receive(agent)

    assert isinstance(lease, Lease) and (lease.mode, lease.inner) == ("sync", None)


async def test_a_lease_of_the_next_round_names_the_version_to_rebase_onto(connect: Connect) -> None:
    await sync_to_async(make_campaign)(**{**LOCAL, "staleness": 1})
    first_agent, second_agent = await greeted_agent(connect), await greeted_agent(connect)

    await send(first_agent, LeaseRequest(samples_per_s=1e6))  # the whole round of 32: step 0 is full
    first = await receive(first_agent)
    await send(second_agent, LeaseRequest(samples_per_s=1e6))
    following = await receive(second_agent)

    assert isinstance(first, Lease) and (first.base_version, first.rebase_to, first.round_base) == (0, None, 0)
    # Version 1 is not made yet: the lease is on version 0 and counts in step 1, whose base is version 1.
    assert isinstance(following, Lease) and (following.base_version, following.rebase_to) == (0, 1)
    assert following.round_base == 1
    # Its inner rate follows the schedule of its round: step 1 is the second of 4 warmup steps.
    assert first.inner is not None and following.inner is not None
    assert (first.inner.lr, following.inner.lr) == (pytest.approx(4e-3 / 4), pytest.approx(4e-3 / 2))
    rows = await sync_to_async(lambda: list(LeaseRow.objects.order_by("id").values_list("target_step", flat=True)))()
    assert rows == [0, 1]


async def test_an_agent_of_minor_3_is_told_to_upgrade_for_an_overlapped_local_lease(connect: Connect) -> None:
    await sync_to_async(make_campaign)(**{**LOCAL, "staleness": 1})
    current = await greeted_agent(connect)
    await send(current, LeaseRequest(samples_per_s=1e6))
    assert isinstance(await receive(current), Lease)  # round 0 is all out: the next lease overlaps it

    frame, closed = await lease_asked_by_an_agent_of_minor(3)

    assert frame["kind"] == "error" and "rebase_to" in frame["detail"] and "2.4" in frame["detail"]
    assert (closed["type"], closed["code"]) == ("websocket.close", 4004)
    states = await sync_to_async(lambda: list(LeaseRow.objects.order_by("id").values_list("state", flat=True)))()
    assert states == [LeaseRow.State.ACTIVE, LeaseRow.State.RELEASED]


def test_a_site_pinned_below_2_4_refuses_overlapped_local_rounds() -> None:
    with override_settings(CROWDTRAIN_PROTOCOL_MINOR=3), pytest.raises(CampaignConfigError) as caught:
        make_campaign(**{**LOCAL, "staleness": 1})

    assert caught.value.field == "staleness"
    assert "need protocol 2.4, and this site is pinned to 2.3" in str(caught.value)
    make_campaign(**LOCAL)  # staleness 0: rounds in lock step need nothing newer


async def test_an_agent_of_minor_2_is_told_to_upgrade_and_its_local_lease_goes_back() -> None:
    await sync_to_async(make_campaign)(**LOCAL)

    frame, closed = await lease_asked_by_an_agent_of_minor(2)

    states = await sync_to_async(lambda: list(LeaseRow.objects.values_list("state", flat=True)))()
    assert frame["kind"] == "error" and "mode" in frame["detail"] and "2.3" in frame["detail"]
    assert (closed["type"], closed["code"]) == ("websocket.close", 4004)
    assert states == [LeaseRow.State.RELEASED]


@pytest.mark.parametrize(
    ("settings", "field", "words"),
    [
        ({"check_fraction": 0.05}, "check_fraction", "local mode cannot verify leases by a second copy"),
        ({"staleness": 2}, "staleness", "Staleness is 2, but local mode overlaps at most one round"),
        ({"inner_optimizer": "lamb"}, "inner_optimizer", "must be one of adamw, sgd"),
        ({"inner_lr": 0.0}, "inner_lr", "Inner learning rate (inner_lr) must be above 0"),
        ({"inner_weight_decay": 2.0}, "inner_weight_decay", "Inner weight decay"),
        ({"training_mode": "async"}, "training_mode", "sync, local"),
        ({"inner_batch_size": 6}, "inner_batch_size", "must be a multiple of the microbatch size (4)"),
        ({"inner_batch_size": 64}, "inner_batch_size", "must not exceed the target batch size (32)"),
        (
            {"optimizer": {"name": "sgd", "lr": 0.7, "momentum": 0.0, "nesterov": True}},
            "nesterov",
            "needs a momentum above 0",
        ),
    ],
)
def test_local_settings_that_cannot_train_are_refused_with_the_field_named(
    settings: dict[str, object], field: str, words: str
) -> None:
    with pytest.raises(CampaignConfigError) as caught:
        make_campaign(**{**LOCAL, **settings})

    assert caught.value.field == field
    assert words in str(caught.value)


def test_a_site_pinned_below_2_3_refuses_a_local_campaign() -> None:
    with override_settings(CROWDTRAIN_PROTOCOL_MINOR=2), pytest.raises(CampaignConfigError) as caught:
        make_campaign(**LOCAL)

    assert caught.value.field in ("training_mode", "nesterov")
    assert "pinned to 2.2" in str(caught.value) or "protocol cannot send" in str(caught.value)
