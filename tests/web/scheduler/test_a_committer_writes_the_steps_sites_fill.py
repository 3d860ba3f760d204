"""Where a committer runs, a report that fills a step only queues it and the committer writes it; without
one, or once it stopped or died, the site writes the step itself, and never twice."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import override_settings

from crowdtrain.campaigns.models import Campaign, Step
from crowdtrain.scheduler import endings, leasing, reporting
from crowdtrain.scheduler.committer import ALIVE_S, RENEW_S, Committer, parse_entry
from crowdtrain.scheduler.hotstate import hot_state
from tests.conftest import FakeClock
from tests.factories import done_for, make_campaign, make_device

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def small_steps_go_too() -> Any:
    """These steps have two leases; by default only steps of hundreds go to a committer."""
    with override_settings(CROWDTRAIN_COMMITTER_MIN_LEASES=2):
        yield


def _full_step(clock: FakeClock) -> tuple[Campaign, int, list[int], reporting.DoneOutcome]:
    """A campaign whose step 0 (two leases) the second report fills; returns that report's outcome."""
    campaign = make_campaign(target_batch_size=8, microbatch_size=4, staleness=1)
    device, _ = make_device()
    speed = 4.0 / leasing.settings.CROWDTRAIN_LEASE_TARGET_S
    first, second = (leasing.request_lease(device.pk, None, speed) for _ in range(2))
    reporting.report_done(device.pk, done_for(first.lease_id))
    outcome = reporting.report_done(device.pk, done_for(second.lease_id))
    return campaign, device.pk, [first.lease_id, second.lease_id], outcome


def _queued() -> list[Any]:
    state = hot_state()
    return list(state.client.lrange(state.commits_key, 0, -1))


def test_a_running_committer_is_handed_the_full_step_and_writes_it(clock: FakeClock) -> None:
    committer = Committer("test")
    committer.announce()

    campaign, _, lease_ids, outcome = _full_step(clock)

    assert outcome.ack.accepted and outcome.commits == []  # the reporting thread wrote nothing
    assert not Step.objects.filter(campaign=campaign).exists()
    assert _queued() == [f"{campaign.pk}:0"]
    entry = committer.next_entry(wait_s=0.1)
    assert entry == (campaign.pk, 0)
    commits = committer.commit(*entry)
    assert [(c.message.step, c.message.lease_ids) for c in commits] == [(0, lease_ids)]
    campaign.refresh_from_db()
    assert campaign.committed_steps == 1
    assert hot_state().snapshot(campaign.hot_key.hex)["meta"]["open"] == "1"
    assert committer.commit(*entry) == []  # a duplicate entry finds the step written


def test_without_a_committer_the_site_writes_the_step_itself(clock: FakeClock) -> None:
    campaign, _, lease_ids, outcome = _full_step(clock)

    assert [(c.message.step, c.message.lease_ids) for c in outcome.commits] == [(0, lease_ids)]
    assert _queued() == []
    campaign.refresh_from_db()
    assert campaign.committed_steps == 1


def test_a_step_smaller_than_the_least_a_committer_takes_is_written_by_the_site(clock: FakeClock) -> None:
    Committer("test").announce()

    with override_settings(CROWDTRAIN_COMMITTER_MIN_LEASES=3):
        campaign, _, lease_ids, outcome = _full_step(clock)

    assert [(c.message.step, c.message.lease_ids) for c in outcome.commits] == [(0, lease_ids)]
    assert _queued() == []


def test_a_committer_that_stopped_announcing_itself_is_handed_nothing(clock: FakeClock) -> None:
    Committer("gone quiet").announce()
    clock.advance(ALIVE_S + 0.5)

    campaign, _, _, outcome = _full_step(clock)

    assert [c.message.step for c in outcome.commits] == [0] and _queued() == []


def test_a_committer_that_withdrew_is_handed_nothing(clock: FakeClock) -> None:
    committer = Committer("stopping")
    committer.announce()
    committer.withdraw()

    _, _, _, outcome = _full_step(clock)

    assert [c.message.step for c in outcome.commits] == [0]


def test_a_step_queued_for_committers_that_all_died_is_taken_over_by_the_sweep_and_written_once(
    clock: FakeClock,
) -> None:
    dead = Committer("dies")
    dead.announce()
    campaign, _, lease_ids, _ = _full_step(clock)
    entry = dead.next_entry(wait_s=0.1)  # popped; then the process is killed before it takes the step
    assert entry is not None

    clock.advance(ALIVE_S - 1)
    assert endings.sweep_campaign(campaign.pk).commits == []  # it may still be at work: its claim holds
    clock.advance(1.5)  # it has not said it is alive for ALIVE_S, and no other committer is left
    taken_over = endings.sweep_campaign(campaign.pk).commits

    assert [(c.message.step, c.message.lease_ids) for c in taken_over] == [(0, lease_ids)]
    assert dead.commit(*entry) == []  # back from the dead: nothing left to write
    assert Step.objects.filter(campaign=campaign).count() == 1


def test_a_step_taken_by_a_committer_that_died_is_taken_over_though_another_committer_lives(
    clock: FakeClock,
) -> None:
    dead, alive = Committer("dies"), Committer("lives")
    dead.announce()
    campaign, _, lease_ids, _ = _full_step(clock)
    assert dead.next_entry(wait_s=0.1) == (campaign.pk, 0)
    hot_state().run("take", campaign.hot_key.hex, {"step": 0, "name": dead.name})  # then killed mid-write

    clock.advance(ALIVE_S + 0.5)
    alive.announce()
    taken_over = endings.sweep_campaign(campaign.pk).commits

    assert [(c.message.step, c.message.lease_ids) for c in taken_over] == [(0, lease_ids)]
    assert Step.objects.filter(campaign=campaign).count() == 1


def test_a_step_a_live_committer_is_writing_is_left_to_it_until_the_claim_lapses(clock: FakeClock) -> None:
    slow = Committer("slow")
    slow.announce()
    campaign, _, lease_ids, _ = _full_step(clock)
    assert slow.next_entry(wait_s=0.1) == (campaign.pk, 0)
    hot_state().run("take", campaign.hot_key.hex, {"step": 0, "name": slow.name})

    for _ in range(9):  # a long write, the committer saying it is alive every second meanwhile
        clock.advance(1)
        slow.announce()
        assert endings.sweep_campaign(campaign.pk).commits == []
    clock.advance(1.5)  # past COMMIT_CLAIM_S: a write this long is taken for stuck, whoever holds it
    taken_over = endings.sweep_campaign(campaign.pk).commits

    assert [(c.message.step, c.message.lease_ids) for c in taken_over] == [(0, lease_ids)]


def test_a_committer_says_it_is_alive_while_it_writes_a_step(monkeypatch: pytest.MonkeyPatch) -> None:
    committer = Committer("busy")
    state = hot_state()
    writing = threading.Event()

    def long_write(wait_s: float = RENEW_S) -> None:  # stands for a step of thousands of leases being written
        writing.set()
        time.sleep(2 * RENEW_S + 0.5)

    monkeypatch.setattr(committer, "next_entry", long_write)

    async def serve_while_it_writes() -> float | None:
        server = asyncio.create_task(committer.serve())
        await asyncio.to_thread(writing.wait, 5)
        state.client.zrem(state.committer_key, committer.name)  # as if its last word were long ago
        await asyncio.sleep(RENEW_S + 0.5)
        renewed = state.client.zscore(state.committer_key, committer.name)
        committer.stopping = True
        await server
        return renewed

    assert asyncio.run(serve_while_it_writes()) is not None


def test_a_serving_committer_says_it_is_alive_at_once_and_then_once_a_renewal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not once a wait as well: the renewal task alone keeps the entry (a Redis round trip each)."""
    committer = Committer("counted")
    said: list[float] = []
    announce = committer.announce

    def counted() -> None:
        said.append(time.monotonic())
        announce()

    monkeypatch.setattr(committer, "announce", counted)

    async def serve_a_while() -> float:
        started = time.monotonic()
        server = asyncio.create_task(committer.serve())
        await asyncio.sleep(2.5 * RENEW_S)
        committer.stopping = True
        await server
        return started

    started = asyncio.run(serve_a_while())

    assert said and said[0] - started < RENEW_S / 2
    assert len(said) <= 4  # at 0, 1, 2 renewals (and a late one while the last wait ends); twice that before


@pytest.mark.parametrize(
    ("text", "entry"),
    [("7:12", (7, 12)), ("0:0", (0, 0)), ("7", None), ("7:", None), (":3", None), ("a:1", None), ("7:-1", None),
     ("7:1:2", None), ("", None), ("7:1e3", None), ("7:\u00b2", None)],
)  # fmt: skip
def test_queue_entries_are_read_strictly(text: str, entry: tuple[int, int] | None) -> None:
    assert parse_entry(text) == entry


def test_an_entry_it_cannot_read_is_skipped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="crowdtrain.scheduler.committer")
    state = hot_state()
    state.client.rpush(state.commits_key, "not an entry")

    assert Committer("reader").next_entry(wait_s=0.1) is None
    assert "ignoring a commit queue entry" in caplog.text


def test_a_committer_for_a_site_without_redis_says_what_to_do() -> None:
    with override_settings(CROWDTRAIN_SCHEDULER_REDIS_URL=""), pytest.raises(CommandError, match="REDIS_URL"):
        call_command("run_committer")
