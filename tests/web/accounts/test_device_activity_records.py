"""A connection's record of what it told its device: the newest lease while any is held, the queue, the report."""

from __future__ import annotations

from typing import Any

import pytest

from crowdtrain.devices import activity
from crowdtrain.devices.activity import Activity, Tracker, decode_activity, describe, duration, plural
from crowdtrain.scheduler.hotstate import Presence
from crowdtrain_agent.protocol import DoneAck, NoLease, ReleaseAck
from crowdtrain_agent.protocol import Lease as LeaseMessage


@pytest.fixture
def presence(monkeypatch: pytest.MonkeyPatch) -> Presence:
    own = Presence()
    own.connected(5)
    monkeypatch.setattr(activity, "presence", own)
    return own


def _now(presence: Presence) -> Activity:
    found = decode_activity(presence.newest(5))
    assert found is not None
    return found


def _lease(lease_id: int, samples: int = 4) -> LeaseMessage:
    return LeaseMessage(
        lease_id=lease_id, campaign_id=2, base_version=0, ranges=[], num_samples=samples, microbatch_size=4,
        deadline_s=60.0, ticket="t", codec="fp32", model={"architecture": "gpt", "config": {}},
        data={"kind": "text", "sample_len": 9}, param_count=1, slices=[],
    )  # type: ignore[arg-type]  # fmt: skip


def test_it_shows_the_newest_lease_held_until_all_are_reported(presence: Presence) -> None:
    tracker = Tracker(5)

    tracker.told(_lease(10))
    tracker.told(_lease(11, samples=8))
    both = _now(presence)
    tracker.told(DoneAck(lease_id=11, accepted=True))
    one = _now(presence)
    tracker.told(DoneAck(lease_id=10, accepted=False, reason="lease expired"))
    none = _now(presence)

    assert (both.kind, both.lease_id, both.num_samples, both.held) == ("training", 11, 8, 2)
    assert (one.kind, one.lease_id, one.held) == ("training", 10, 1)
    assert (none.kind, none.lease_id, none.accepted, none.detail) == ("reported", 10, False, "lease expired")
    assert describe(none, {2: "shakespeare"}, none.at)["text"] == (
        "reported lease 10 of shakespeare: not counted (lease expired)"
    )


def test_a_request_queued_while_training_shows_once_the_training_is_reported(presence: Presence) -> None:
    tracker = Tracker(5)
    tracker.told(_lease(10))

    tracker.queued(campaign_id=2, ready_at_step=3)
    while_training = _now(presence)
    tracker.told(DoneAck(lease_id=10, accepted=True))
    after = _now(presence)
    tracker.told(NoLease(reason="step_full", detail="step 3 is full", retry_after_s=1.0))
    refused = _now(presence)

    assert while_training.kind == "training"
    assert (after.kind, after.ready_at_step) == ("queued", 3)
    assert refused.kind == "idle" and refused.reason == "step_full"


def test_a_lease_given_back_unfinished_says_so(presence: Presence) -> None:
    tracker = Tracker(5)
    tracker.told(_lease(10))

    tracker.told(ReleaseAck(lease_id=10))

    released = _now(presence)
    assert describe(released, {}, released.at)["text"] == "gave back lease 10 of campaign 2 unfinished"


def test_a_device_its_volunteer_paused_says_why_until_it_works_again(presence: Presence) -> None:
    # Issue 34: "paused: outside your schedule" on My devices, as in the agent's panel.
    tracker = Tracker(5)

    tracker.paused("outside your schedule")
    paused = _now(presence)
    tracker.paused("")
    resumed = _now(presence)

    assert describe(paused, {}, paused.at)["text"] == "paused: outside your schedule"
    assert resumed.kind == "connected"


def test_leases_never_reported_are_forgotten_beyond_a_few(presence: Presence) -> None:
    tracker = Tracker(5)

    for lease_id in range(1, 21):
        tracker.told(_lease(lease_id))

    assert _now(presence).held == activity.MAX_HELD


@pytest.mark.parametrize(
    ("count", "words"), [(0, "0 samples"), (1, "1 sample"), (2, "2 samples"), (1000, "1000 samples")]
)
def test_counts_are_pluralized(count: int, words: str) -> None:
    assert plural(count, "sample") == words


@pytest.mark.parametrize(
    ("seconds", "words"), [(0.4, "0 s"), (8, "8 s"), (60, "1 min"), (125, "2 min 5 s"), (4200, "1 h 10 min")]
)
def test_waits_read_as_people_say_them(seconds: float, words: str) -> None:
    assert duration(seconds) == words


def test_a_lease_past_its_deadline_says_how_long_ago_it_was_due() -> None:
    said: dict[str, Any] = describe(
        Activity(kind="training", at=0.0, campaign_id=None, lease_id=4, num_samples=1, deadline=100.0, held=1),
        {}, now=130.0,
    )  # fmt: skip

    assert said["text"] == "training lease 4 (1 sample, due 30 s ago)"
