from __future__ import annotations

import json

import pytest
from asgiref.sync import sync_to_async

from crowdtrain.gateway.outbox import campaign_agents_group, revoke_device, send_to_group
from crowdtrain_agent.protocol import (
    CloseCode,
    DoneAck,
    ErrorMessage,
    Lease,
    LeaseRequest,
    NoLease,
    VersionPublished,
    Welcome,
    encode_message,
)
from tests.factories import done_for, make_campaign, make_device

from .conftest import HELLO, Connect, receive, send

pytestmark = pytest.mark.django_db(transaction=True)


async def test_it_answers_bad_messages_and_keeps_the_connection(connect: Connect) -> None:
    _, token = await sync_to_async(make_device)()
    communicator, connected, _ = await connect("/ws/agent/", token)
    bad_frames = [
        "{not json",
        json.dumps({"kind": "launch_missiles"}),
        json.dumps({"kind": "lease_request", "campaign_id": "seven"}),
        json.dumps({"kind": "hello", "agent_version": "x"}),
        json.dumps({"kind": "lease_request", "wait_s": int("9" * 400)}),
    ]
    replies = []

    for frame in bad_frames:
        await communicator.send_to(text_data=frame)
        replies.append(await receive(communicator))
    await send(communicator, HELLO)
    welcome = await receive(communicator)

    assert connected
    assert all(isinstance(r, ErrorMessage) for r in replies)
    assert "malformed json" in replies[0].detail
    assert "unknown message kind 'launch_missiles'" in replies[1].detail
    assert "LeaseRequest.campaign_id: expected int" in replies[2].detail
    assert "missing field" in replies[3].detail
    assert "LeaseRequest.wait_s: number out of range" in replies[4].detail
    assert isinstance(welcome, Welcome)


async def test_a_message_over_the_size_limit_is_answered_and_closes_with_4008(connect: Connect) -> None:
    _, token = await sync_to_async(make_device)()
    communicator, _, _ = await connect("/ws/agent/", token)
    # 30,000 three-byte characters: under the limit in characters, over it in bytes.
    await communicator.send_to(text_data=json.dumps({"kind": "heartbeat", "pad": "€" * 30_000}, ensure_ascii=False))

    reply = await receive(communicator)
    closed = await communicator.receive_output(timeout=5)

    assert isinstance(reply, ErrorMessage) and reply.code == "too large"
    assert (closed["type"], closed["code"]) == ("websocket.close", 4008)


async def test_it_wants_hello_before_anything_else(connect: Connect) -> None:
    _, token = await sync_to_async(make_device)()
    communicator, _, _ = await connect("/ws/agent/", token)

    await send(communicator, LeaseRequest())
    reply = await receive(communicator)

    assert isinstance(reply, ErrorMessage)
    assert "send hello before 'lease_request'" in reply.detail


async def test_it_refuses_binary_frames_on_the_control_channel(connect: Connect) -> None:
    _, token = await sync_to_async(make_device)()
    communicator, _, _ = await connect("/ws/agent/", token)

    await communicator.send_to(bytes_data=b"\x00" * 16)
    reply = await receive(communicator)

    assert isinstance(reply, ErrorMessage)
    assert "binary frames are not accepted" in reply.detail


async def test_it_closes_an_agent_speaking_another_protocol_version(connect: Connect) -> None:
    _, token = await sync_to_async(make_device)()
    communicator, _, _ = await connect("/ws/agent/", token)

    await communicator.send_to(text_data=json.dumps({**json.loads(encode_message(HELLO)), "protocol_version": 99}))
    output = await communicator.receive_output(timeout=5)

    # The close alone, no error frame first: an agent of another major reads any frame as a failed connect.
    assert output["type"] == "websocket.close" and output["code"] == CloseCode.UNSUPPORTED_VERSION
    assert "protocol version 99 is not supported" in output["reason"]
    assert "upgrade crowdtrain-agent" in output["reason"] and len(output["reason"].encode()) <= 123


async def test_an_agent_leases_reports_and_gets_its_ack(connect: Connect) -> None:
    await sync_to_async(make_campaign)(target_batch_size=64)
    _, token = await sync_to_async(make_device)()
    communicator, _, _ = await connect("/ws/agent/", token)
    await send(communicator, HELLO)
    await receive(communicator)

    await send(communicator, LeaseRequest())
    lease = await receive(communicator)
    await send(communicator, await sync_to_async(done_for)(lease.lease_id))
    ack = await receive(communicator)

    assert isinstance(lease, Lease)
    assert isinstance(ack, DoneAck) and ack.accepted and ack.step == 0


async def test_an_idle_agent_is_told_why_and_when_to_ask_again(connect: Connect) -> None:
    _, token = await sync_to_async(make_device)()
    communicator, _, _ = await connect("/ws/agent/", token)
    await send(communicator, HELLO)
    await receive(communicator)

    await send(communicator, LeaseRequest())
    reply = await receive(communicator)

    assert isinstance(reply, NoLease)
    assert reply.reason == "no_campaign" and reply.retry_after_s > 0


async def test_revoking_a_device_disconnects_its_agent_within_seconds(connect: Connect) -> None:
    device, token = await sync_to_async(make_device)()
    communicator, _, _ = await connect("/ws/agent/", token)
    await send(communicator, HELLO)
    await receive(communicator)

    await revoke_device(device.pk, "revoked in the browser")
    output = await communicator.receive_output(timeout=5)

    assert output == {"type": "websocket.close", "code": CloseCode.REVOKED}


async def test_one_agents_bad_messages_do_not_disturb_another(connect: Connect) -> None:
    await sync_to_async(make_campaign)(target_batch_size=64)
    _, bad_token = await sync_to_async(make_device)("mallory")
    _, good_token = await sync_to_async(make_device)("alice")
    bad, _, _ = await connect("/ws/agent/", bad_token)
    good, _, _ = await connect("/ws/agent/", good_token)
    await send(good, HELLO)
    await receive(good)

    for _ in range(25):
        await bad.send_to(text_data="garbage")
    await send(good, LeaseRequest())
    lease = await receive(good)

    assert isinstance(lease, Lease)
    closed = [
        out for out in [await bad.receive_output(timeout=5) for _ in range(22)] if out["type"] == "websocket.close"
    ]
    assert closed == [{"type": "websocket.close", "code": CloseCode.TOO_MANY_ERRORS}]


async def test_it_refuses_a_request_id_longer_than_it_can_store(connect: Connect) -> None:
    _, token = await sync_to_async(make_device)()
    communicator, _, _ = await connect("/ws/agent/", token)
    await send(communicator, HELLO)
    await receive(communicator)

    await send(communicator, LeaseRequest(request_id="x" * 65))
    reply = await receive(communicator)

    assert isinstance(reply, ErrorMessage)
    assert "LeaseRequest.request_id: expected str of length <= 64" in reply.detail


async def test_a_stranger_asking_for_an_invite_only_campaign_hears_nothing_of_it(connect: Connect) -> None:
    campaign = await sync_to_async(make_campaign)(visibility="invite")
    _, token = await sync_to_async(make_device)("stranger")
    communicator, _, _ = await connect("/ws/agent/", token)
    await send(communicator, HELLO)
    await receive(communicator)

    await send(communicator, LeaseRequest(campaign_id=campaign.pk))
    reply = await receive(communicator)
    await send_to_group(campaign_agents_group(campaign.pk), VersionPublished(campaign_id=campaign.pk, version=3))

    assert isinstance(reply, NoLease) and reply.reason == "no_campaign"
    assert await communicator.receive_nothing(timeout=0.5)  # no version pushes, no loss figures
