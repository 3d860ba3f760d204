"""A campaign is never assigned, stripped, to an aggregator of an older protocol minor.

A 2.0 aggregator cannot carry ``assign.ticket_key`` (each campaign's own key for
tickets and receipts, 2.1), so it is told to upgrade (4004) at its hello, before
it joins: no welcome, no key, no slice, and the campaign goes on waiting for an
aggregator that can serve it. A site pinned to 2.0 (CROWDTRAIN_PROTOCOL_MINOR=0)
still serves it: one key for every campaign, in the welcome.
"""

from __future__ import annotations

import json

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.test import override_settings

from crowdtrain.accounts.tokens import hash_token
from crowdtrain.asgi import application
from crowdtrain.campaigns.models import Campaign
from crowdtrain.scheduler.models import Aggregator
from crowdtrain_agent.protocol import OLDEST_MINOR, PROTOCOL_MINOR
from tests.factories import make_campaign

pytestmark = pytest.mark.django_db(transaction=True)

HELLO_2_0 = {"kind": "backbone_hello", "protocol_version": 2, "name": "agg-old", "upload_url": "ws://x/upload",
             "params_url": "http://x/params/"}  # fmt: skip


def _setup(decay_all: bool) -> str:
    Campaign.objects.all().delete()
    optimizer = {"name": "adamw", "weight_decay": 0.1, **({"decay_all": True} if decay_all else {})}
    campaign = make_campaign(optimizer=optimizer)
    campaign.slices.all().delete()
    Aggregator.objects.all().delete()  # the campaign's own goes: the old one is the only one live
    Aggregator.objects.create(name="agg-old", token_hash=hash_token("secret-old"))
    return "secret-old"


async def _connect_2_0(token: str) -> WebsocketCommunicator:
    old = WebsocketCommunicator(application, "/ws/backbone/", headers=[(b"authorization", f"Bearer {token}".encode())])
    connected, subprotocol = await old.connect()  # offers no subprotocol: a 2.0 aggregator
    assert connected and subprotocol is None
    await old.send_to(text_data=json.dumps(HELLO_2_0))
    return old


async def test_an_aggregator_of_minor_0_is_told_to_upgrade_before_it_joins() -> None:
    token = await sync_to_async(_setup)(False)
    old = await _connect_2_0(token)

    frame = json.loads(await old.receive_from(timeout=5))
    closed = await old.receive_output(timeout=5)
    joined = await sync_to_async(
        lambda: list(Aggregator.objects.filter(connected=True).values_list("name", flat=True))
    )()
    slices = await sync_to_async(lambda: Campaign.objects.get().slices.count())()
    assert frame["kind"] == "error" and frame["code"] == "unsupported version"
    if OLDEST_MINOR == 0:
        assert "assign.ticket_key" in frame["detail"] and "upgrade" in frame["detail"]
        assert "CROWDTRAIN_PROTOCOL_MINOR=0" in frame["detail"]
    else:  # since 2.2 the site speaks only 2.1 and newer: the version check refuses it first
        assert f"this site speaks 2.{OLDEST_MINOR} to 2.{PROTOCOL_MINOR}" in frame["detail"]
        assert "upgrade" in frame["detail"]
    assert (closed["type"], closed["code"]) == ("websocket.close", 4004)
    assert joined == [] and slices == 0
    await old.disconnect()


async def test_a_site_pinned_to_2_0_gives_it_the_one_key_and_plain_assignments() -> None:
    token = await sync_to_async(_setup)(False)
    with override_settings(CROWDTRAIN_PROTOCOL_MINOR=0):
        old = await _connect_2_0(token)
        welcome = json.loads(await old.receive_from(timeout=5))
        frame = json.loads(await old.receive_from(timeout=5))
        await old.disconnect()

    assert bytes.fromhex(welcome["ticket_key"]) == settings.CROWDTRAIN_TICKET_KEY
    assert frame["kind"] == "assign" and "ticket_key" not in frame and "codec" not in frame
    assert "decay_all" not in frame["optimizer"]
