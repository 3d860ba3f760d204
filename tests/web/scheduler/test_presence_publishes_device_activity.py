"""Presence's batch writes the activity records that changed, keeps them alive, deletes its own on leaving."""

from __future__ import annotations

import pytest

from crowdtrain.scheduler import hotstate
from crowdtrain.scheduler.hotstate import ACTIVITY_TTL_S, Presence, hot_state
from tests.conftest import FakeClock


def _stored(device_id: int) -> str | None:
    return hot_state().client.get(hot_state().activity_key(device_id))


def test_only_records_that_changed_are_written(clock: FakeClock) -> None:
    presence = Presence()
    for device_id in (1, 2):
        presence.connected(device_id)
        presence.note(device_id, f"first of {device_id}")
    presence.publish()
    hot_state().client.set(hot_state().activity_key(1), "left alone")  # so a rewrite would show

    presence.note(2, "second of 2")
    presence.publish()

    assert (_stored(1), _stored(2)) == ("left alone", "second of 2")
    assert 0 < hot_state().client.ttl(hot_state().activity_key(2)) <= ACTIVITY_TTL_S


def test_a_device_that_leaves_loses_its_record_at_the_next_batch() -> None:
    presence = Presence()
    presence.connected(7)
    presence.note(7, "training")
    presence.publish()

    presence.disconnected(7)
    presence.publish()

    assert _stored(7) is None


def test_a_device_still_connected_once_more_keeps_its_record() -> None:
    presence = Presence()
    presence.connected(7)
    presence.connected(7)  # its reconnect arrived before the old socket's close
    presence.note(7, "training")
    presence.publish()

    presence.disconnected(7)
    presence.publish()

    assert _stored(7) == "training"


def test_news_for_a_socket_that_closed_is_dropped() -> None:
    presence = Presence()

    presence.note(9, "late answer")
    presence.publish()

    assert _stored(9) is None


def test_the_newer_connection_on_another_process_keeps_its_record() -> None:
    old_process, new_process = Presence(), Presence()
    old_process.connected(7)
    old_process.note(7, "old socket's news")
    old_process.publish()
    new_process.connected(7)
    new_process.note(7, "new socket's news")
    new_process.publish()

    old_process.disconnected(7)  # daphne noticed the dead socket after the agent reconnected elsewhere
    old_process.publish()

    assert _stored(7) == "new socket's news"


def test_unchanged_records_are_kept_alive_without_being_rewritten(clock: FakeClock) -> None:
    old_process, new_process = Presence(), Presence()
    old_process.connected(7)
    old_process.note(7, "old socket's news")
    old_process.publish()
    new_process.connected(7)
    new_process.note(7, "new socket's news")
    new_process.publish()
    hot_state().client.expire(hot_state().activity_key(7), 5)

    clock.advance(ACTIVITY_TTL_S / 2 + 1)
    old_process.publish()

    assert _stored(7) == "new socket's news"
    assert hot_state().client.ttl(hot_state().activity_key(7)) > ACTIVITY_TTL_S - 60


def test_a_batch_that_failed_is_written_by_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    presence = Presence()
    presence.connected(3)
    presence.note(3, "idle")
    real_pipeline = hot_state().client.pipeline

    def broken(*args: object, **kwargs: object) -> object:
        raise ConnectionError("redis is restarting")

    monkeypatch.setattr(hot_state().client, "pipeline", broken)
    with pytest.raises(ConnectionError):
        presence.publish()
    monkeypatch.setattr(hot_state().client, "pipeline", real_pipeline)
    presence.publish()

    assert _stored(3) == "idle"
    assert hotstate.presence is not presence  # the process's own was not touched
