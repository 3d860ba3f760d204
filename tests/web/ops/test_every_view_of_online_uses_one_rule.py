"""The device list, the swarm page, its join counter and /metrics agree on who is online: one rule says it."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.test import Client

from crowdtrain.devices.actions import online_ids
from crowdtrain.ops import swarm
from crowdtrain.scheduler.hotstate import hot_state
from tests.conftest import FakeClock
from tests.factories import make_device

from .scrape import scrape, value

pytestmark = pytest.mark.django_db


def test_a_device_is_online_until_gone_after_s_past_its_last_stamp(clock: FakeClock) -> None:
    fresh, _ = make_device("fresh")
    edge, _ = make_device("edge")
    gone, _ = make_device("gone")
    state = hot_state()
    state.mark_seen([fresh.pk], at=clock.now)
    state.mark_seen([edge.pk], at=clock.now - settings.CROWDTRAIN_GONE_AFTER_S)
    state.mark_seen([gone.pk], at=clock.now - settings.CROWDTRAIN_GONE_AFTER_S - 1)

    listed = online_ids([fresh, edge, gone])
    counted = swarm.online().count
    flagged = {agent["id"] for agent in swarm.most_recently_seen() if agent["online"]}
    joined, _ = swarm.joins_and_departures()
    scraped = value(scrape(Client()), "crowdtrain_agents_online")

    assert listed == flagged == set(state.online_ids()) == {fresh.pk, edge.pk}
    assert counted == joined == scraped == 2
