"""Each batch stamps exactly the process's connected devices as seen, sending Redis only who came and went."""

from __future__ import annotations

from typing import Any

import pytest

from crowdtrain.scheduler.hotstate import Presence, hot_state
from tests.conftest import FakeClock


def _seen(device_ids: list[int]) -> dict[int, float]:
    return hot_state().last_seen(device_ids)


def test_connected_devices_are_stamped_each_batch_and_those_that_left_are_not(clock: FakeClock) -> None:
    presence = Presence()
    for device_id in (1, 2, 3):
        presence.connected(device_id)
    presence.publish()
    clock.advance(5)
    presence.disconnected(2)
    presence.connected(4)
    presence.connected(3)  # a second socket: one close later, it is still here

    presence.disconnected(3)
    presence.publish()

    assert _seen([1, 2, 3, 4]) == {1: clock.now, 2: clock.now - 5, 3: clock.now, 4: clock.now}


def test_a_set_redis_lost_is_sent_whole_in_the_same_batch(clock: FakeClock) -> None:
    presence = Presence()
    for device_id in range(1, 2501):
        presence.connected(device_id)
    presence.publish()
    hot_state().client.delete(hot_state().here_key(presence._here))  # Redis restarted empty, say
    clock.advance(5)

    assert presence.publish() == 2500
    assert set(_seen(list(range(1, 2501))).values()) == {clock.now}


def test_an_unchanged_batch_sends_no_member(clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> None:
    presence = Presence()
    for device_id in range(1, 1001):
        presence.connected(device_id)
    presence.publish()
    sent: list[tuple[Any, ...]] = []
    real = type(hot_state().client.pipeline()).execute_command

    def recording(self: Any, *args: Any, **kwargs: Any) -> Any:
        sent.append(args)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(hot_state().client.pipeline()), "execute_command", recording)
    clock.advance(5)

    presence.publish()

    assert max(len(args) for args in sent) < 10  # no command carries the 1,000 devices
    assert set(_seen(list(range(1, 1001))).values()) == {clock.now}


def test_a_failed_batch_is_followed_by_the_whole_set(clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> None:
    presence = Presence()
    presence.connected(1)
    presence.publish()
    presence.connected(2)
    pipeline = type(hot_state().client.pipeline())
    real = pipeline.execute
    monkeypatch.setattr(pipeline, "execute", lambda self, *a, **k: (_ for _ in ()).throw(ConnectionError("away")))
    with pytest.raises(ConnectionError):
        presence.publish()
    monkeypatch.setattr(pipeline, "execute", real)
    clock.advance(5)

    presence.publish()

    assert _seen([1, 2]) == {1: clock.now, 2: clock.now}
