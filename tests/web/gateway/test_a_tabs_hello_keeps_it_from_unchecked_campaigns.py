"""The hello's device kind decides the lease path's: a browser tab waits for its campaign's graph, an agent does not."""

from __future__ import annotations

from typing import Any, cast

import pytest
from asgiref.sync import sync_to_async
from django.test import override_settings

from crowdtrain.browser import checking
from crowdtrain.scheduler import browser_tabs, leasing
from crowdtrain_agent.protocol import PROTOCOL_VERSION, AgentHello, DeviceInfo, Lease, LeaseRequest, NoLease
from tests.factories import make_campaign, make_device

from .conftest import Connect, receive, send

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize("kind", ["cpu", "browser"])
async def test_only_a_tab_is_told_the_campaign_is_being_checked(
    connect: Connect, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    queued: list[int] = []
    monkeypatch.setattr(checking, "dispatch", queued.append)  # no export here: the answer is what is tested
    campaign = await sync_to_async(make_campaign)()
    _, token = await sync_to_async(make_device)("vera", "this device")
    agent, _, _ = await connect("/ws/agent/", token)
    device = DeviceInfo(kind=cast(Any, kind), name="x")  # "browser" is protocol 2.10's
    hello = AgentHello(protocol_version=PROTOCOL_VERSION, agent_version="test", device=device)

    with override_settings(CROWDTRAIN_BROWSER_GRAPHS=True):
        await send(agent, hello)
        await receive(agent)  # welcome
        await send(agent, LeaseRequest(campaign_id=campaign.pk))
        answer = await receive(agent)

    if kind == "browser":
        assert len(queued) == 1, "the tab's request queues the check nobody ran"
        assert isinstance(answer, NoLease) and answer.reason == "campaign_paused"
        assert (
            answer.detail
            == f"browser compute is not offered for campaign {campaign.pk} yet: its model is being checked"
        )
    else:
        assert isinstance(answer, Lease) and queued == []


async def test_what_a_hello_said_is_forgotten_when_its_socket_closes(connect: Connect) -> None:
    """The per-process caches hold the devices connected now, not every device a long-lived site has seen."""
    _, token = await sync_to_async(make_device)("vera", "a tab")
    agent, _, _ = await connect("/ws/agent/", token)
    device = DeviceInfo(kind="browser", name="Chromium tab", flops_per_s=2.0e9)
    await send(agent, AgentHello(protocol_version=PROTOCOL_VERSION, agent_version="test", device=device))
    welcome = await receive(agent)
    assert browser_tabs._kinds.get(welcome.device_id) == "browser"
    assert leasing._hardware_flops.get(welcome.device_id) == 2.0e9

    await agent.disconnect()

    assert welcome.device_id not in browser_tabs._kinds
    assert welcome.device_id not in leasing._hardware_flops
