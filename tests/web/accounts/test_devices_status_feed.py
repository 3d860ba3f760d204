"""GET /devices/status: my devices only, what each does now, speed, samples, newest leases; bounded queries."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from crowdtrain.accounts.models import Device
from crowdtrain.campaigns.models import Campaign
from crowdtrain.devices import status as device_status
from crowdtrain.devices.activity import Activity, encode_activity
from crowdtrain.scheduler.hotstate import hot_state
from crowdtrain.scheduler.models import Lease
from tests.factories import logged_in, make_campaign

pytestmark = pytest.mark.django_db


def _device(owner: AbstractBaseUser, name: str, *, online: bool = True, **fields: object) -> Device:
    device, _ = Device.issue(owner, name)
    seen_s_ago = 1.0 if online else settings.CROWDTRAIN_GONE_AFTER_S + 60
    device.last_seen_at = timezone.now() - timedelta(seconds=seen_s_ago)
    hot_state().mark_seen([device.pk], at=hot_state().clock() - seen_s_ago)
    for field, value in fields.items():
        setattr(device, field, value)
    device.save()
    return device


def _publish(device: Device, activity: Activity) -> None:
    """As Presence's batch writes a connection's record."""
    hot_state().client.set(hot_state().activity_key(device.pk), encode_activity(activity))


def _leases(campaign: Campaign, device: Device, count: int, *, samples: int = 2) -> list[Lease]:
    done = timezone.now()
    return [
        Lease.objects.create(
            campaign=campaign,
            device=device,
            base_version=0,
            ranges=[],
            num_samples=samples,
            state=Lease.State.ACCEPTED,
            deadline=done,
            finished_at=done,
            compute_s=0.25,
        )  # fmt: skip
        for _ in range(count)
    ]


def _feed(user: AbstractBaseUser) -> dict[int, dict[str, object]]:
    response = logged_in(user).get("/devices/status")
    assert response.status_code == 200 and response["Content-Type"] == "application/json"
    return {row["id"]: row for row in response.json()["devices"]}


def test_it_lists_only_my_devices(owner: AbstractBaseUser, stranger: AbstractBaseUser) -> None:
    mine = _device(owner, "desk gpu")
    theirs = _device(stranger, "someone else's rig")
    _publish(theirs, Activity(kind="connected", at=hot_state().clock()))

    feed = _feed(owner)
    other = _feed(stranger)

    assert list(feed) == [mine.pk]
    assert list(other) == [theirs.pk]
    assert "someone else" not in logged_in(owner).get("/devices/status").content.decode()


def test_anonymous_visitors_get_a_json_403(client: Client) -> None:
    response = client.get("/devices/status")

    assert response.status_code == 403
    assert response.json() == {"error": "sign in to see your devices"}


def test_it_answers_get_only(owner: AbstractBaseUser) -> None:
    _device(owner, "desk gpu")

    assert logged_in(owner).post("/devices/status").status_code == 405


def test_it_says_what_a_training_device_does_its_speed_samples_and_newest_leases(owner: AbstractBaseUser) -> None:
    campaign = make_campaign()
    device = _device(owner, "desk gpu", samples_per_s=31.25, samples_accepted=1)
    leases = _leases(campaign, device, 12, samples=1)
    now = hot_state().clock()
    _publish(device, Activity(kind="training", at=now, campaign_id=campaign.pk, lease_id=99, num_samples=1,
                              deadline=now + 90.4, held=1))  # fmt: skip

    row = _feed(owner)[device.pk]

    assert row["online"] is True and row["revoked"] is False
    assert row["now_text"] == "training lease 99 of test campaign (1 sample, due in 1 min 30 s)"
    assert row["now"]["campaign"] == {"id": campaign.pk, "name": "test campaign"}  # type: ignore[index]
    assert row["now"]["lease_id"] == 99 and row["now"]["expected_wait_s"] is None  # type: ignore[index]
    assert row["speed"] == {"samples_per_s": 31.25, "text": "31.2 samples/s"}
    assert row["samples_accepted"] == 1 and row["samples_accepted_text"] == "1 sample"
    assert row["last_seen_text"] == "now"
    history = row["leases"]
    assert isinstance(history, list) and len(history) == device_status.RECENT_LEASES
    assert [lease["id"] for lease in history] == [lease.pk for lease in reversed(leases)][:10]
    newest = history[0]
    assert newest["campaign"] == {"id": campaign.pk, "name": "test campaign"}
    assert (newest["samples"], newest["samples_text"], newest["state"]) == (1, "1 sample", "accepted")
    assert (newest["compute_s"], newest["compute_text"]) == (0.25, "0.2 s")
    assert newest["finished_at"] and newest["finished"]


def test_an_idle_device_shows_the_refusal_and_the_wait_left(owner: AbstractBaseUser) -> None:
    device = _device(owner, "desk gpu", samples_accepted=2)
    _publish(device, Activity(kind="idle", at=hot_state().clock() - 5.0, reason="campaign_paused",
                              detail="waiting for aggregators", retry_after_s=30.0))  # fmt: skip

    row = _feed(owner)[device.pk]

    assert row["now_text"] == "waiting for work (campaign paused: waiting for aggregators)"
    assert row["now"]["expected_wait_s"] == pytest.approx(25.0, abs=1.0)  # type: ignore[index]
    assert row["wait_text"] in {"asks again within 25 s", "asks again within 24 s"}
    assert row["samples_accepted_text"] == "2 samples"
    assert row["speed"] == {"samples_per_s": None, "text": "not measured yet"}
    assert row["leases"] == []


def test_an_offline_or_revoked_device_does_nothing_whatever_redis_kept(owner: AbstractBaseUser) -> None:
    offline = _device(owner, "old laptop", online=False)
    revoked = _device(owner, "sold box", revoked_at=timezone.now())
    for device in (offline, revoked):  # left by a site process that died before it could delete them
        _publish(device, Activity(kind="connected", at=hot_state().clock()))

    feed = _feed(owner)

    assert (feed[offline.pk]["online"], feed[offline.pk]["now"], feed[offline.pk]["now_text"]) == (
        False, None, "offline"
    )  # fmt: skip
    assert feed[offline.pk]["last_seen_text"] != "now"
    assert feed[revoked.pk]["now"] is None and feed[revoked.pk]["revoked"] is True
    assert feed[revoked.pk]["now_text"] == "revoked: its agent can no longer connect"


@pytest.mark.parametrize("record", ["not json", '{"kind": "dancing", "at": 1}', '{"kind": "training", "lease_id": "x"}',
                                    "[1, 2]", '{"kind": "idle", "reason": "step_full", "retry_after_s": true}',
                                    '{"kind": "idle", "at": 1}', '{"kind": "training", "at": 1}'])  # fmt: skip
def test_a_record_it_cannot_read_leaves_the_rest_of_the_device_shown(owner: AbstractBaseUser, record: str) -> None:
    device = _device(owner, "desk gpu", samples_accepted=3)
    hot_state().client.set(hot_state().activity_key(device.pk), record)

    row = _feed(owner)[device.pk]

    assert row["online"] is True and row["now"] is None
    assert row["now_text"] == "connected; what it is doing shows here within a few seconds"
    assert row["samples_accepted_text"] == "3 samples"


@pytest.mark.parametrize("union", [True, False], ids=["postgresql-union", "window-function"])
def test_the_feed_costs_the_same_queries_for_one_device_or_many(
    owner: AbstractBaseUser, stranger: AbstractBaseUser, union: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if union and not connection.features.supports_slicing_ordering_in_compound:
        pytest.skip("this database cannot limit the parts of a UNION")
    monkeypatch.setattr(connection.features, "supports_slicing_ordering_in_compound", union)
    campaign = make_campaign()
    first = _device(stranger, "only one")
    _leases(campaign, first, 3)
    many = [_device(owner, f"rig {i}") for i in range(6)]
    for i, device in enumerate(many):
        _leases(campaign, device, 11 + i)
        _publish(device, Activity(kind="training", at=hot_state().clock(), campaign_id=campaign.pk, lease_id=i,
                                  num_samples=2, deadline=hot_state().clock() + 60))  # fmt: skip
    one_browser, many_browser = logged_in(stranger), logged_in(owner)

    with CaptureQueriesContext(connection) as one:
        one_rows = one_browser.get("/devices/status").json()["devices"]
    with CaptureQueriesContext(connection) as several:
        rows = many_browser.get("/devices/status").json()["devices"]

    assert len(one_rows) == 1 and len(one_rows[0]["leases"]) == 3
    assert len(rows) == 6 and all(len(row["leases"]) == 10 for row in rows)
    assert len(several.captured_queries) == len(one.captured_queries)
    assert all(row["now_text"].startswith("training lease") for row in rows)
