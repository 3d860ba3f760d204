"""A campaign is never assigned, stripped, to an aggregator of an older protocol minor.

A 2.0 aggregator cannot carry ``assign.ticket_key`` (each campaign's own key for
tickets and receipts, 2.1): it would check the campaign's tickets with the
welcome's key, so it is told to upgrade (4004) at its first assignment, and
its welcome carries a key that signs nothing (never the site's key, from which
every campaign's key derives). A site pinned to 2.0 (CROWDTRAIN_PROTOCOL_MINOR=0)
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
from crowdtrain_agent.protocol import campaign_key
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


@pytest.mark.parametrize("decay_all", [False, True])
async def test_an_aggregator_of_minor_0_is_told_to_upgrade_and_learns_no_key(decay_all: bool) -> None:
    token = await sync_to_async(_setup)(decay_all)
    old = await _connect_2_0(token)
    welcome = json.loads(await old.receive_from(timeout=5))

    frame = json.loads(await old.receive_from(timeout=5))
    closed = await old.receive_output(timeout=5)
    campaign_id = await sync_to_async(lambda: Campaign.objects.get().pk)()
    assert welcome["kind"] == "backbone_welcome"
    assert bytes.fromhex(welcome["ticket_key"]) not in (
        settings.CROWDTRAIN_TICKET_KEY, campaign_key(settings.CROWDTRAIN_TICKET_KEY, campaign_id)
    )
    assert frame["kind"] == "error" and "ticket_key" in frame["detail"] and "upgrade" in frame["detail"]
    assert ("optimizer.decay_all" in frame["detail"]) == decay_all
    assert (closed["type"], closed["code"]) == ("websocket.close", 4004)
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
