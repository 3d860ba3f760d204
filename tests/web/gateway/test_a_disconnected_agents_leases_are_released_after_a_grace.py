"""An agent whose socket closed does not hold its step until the lease's deadline: after a short grace
for reconnecting, its leases go back."""

from __future__ import annotations

import asyncio

import pytest
from asgiref.sync import sync_to_async
from django.test import override_settings

from crowdtrain.scheduler.models import Lease
from crowdtrain_agent.protocol import LeaseRequest
from tests.factories import make_campaign, make_device

from .conftest import Connect, greeted_agent, receive, send

pytestmark = pytest.mark.django_db(transaction=True)


async def _lease_state(lease_id: int) -> tuple[str, str]:
    for _ in range(50):
        await asyncio.sleep(0.05)
        row = await sync_to_async(Lease.objects.filter(pk=lease_id).values_list("state", "reason").first)()
        if row and row[0] != Lease.State.ACTIVE:
            return row
    return row or ("missing", "")


async def _agent_with_lease(connect: Connect, token: str) -> tuple[object, int]:
    communicator = await greeted_agent(connect, token=token)
    await send(communicator, LeaseRequest())
    lease = await receive(communicator)
    return communicator, lease.lease_id


@override_settings(CROWDTRAIN_DISCONNECT_GRACE_S=0.1)
async def test_the_leases_of_an_agent_that_does_not_come_back_are_released(connect: Connect) -> None:
    await sync_to_async(make_campaign)(target_batch_size=16)
    _, token = await sync_to_async(make_device)("crashes")
    agent, lease_id = await _agent_with_lease(connect, token)

    await agent.disconnect()
    state, reason = await _lease_state(lease_id)

    assert (state, reason) == (Lease.State.RELEASED, "agent disconnected")


@override_settings(CROWDTRAIN_DISCONNECT_GRACE_S=0.5)
async def test_an_agent_that_reconnects_within_the_grace_keeps_its_leases(connect: Connect) -> None:
    await sync_to_async(make_campaign)(target_batch_size=16)
    _, token = await sync_to_async(make_device)("flaky link")
    agent, lease_id = await _agent_with_lease(connect, token)

    await agent.disconnect()
    await greeted_agent(connect, token=token)
    await asyncio.sleep(0.8)

    state = await sync_to_async(Lease.objects.filter(pk=lease_id).values_list("state", flat=True).first)()
    assert state == Lease.State.ACTIVE
