"""A 2.0 agent (recorded frames, no subprotocol offered) still leases, reports and trains against this site.

2.0 decoders refused unknown fields, so everything the site sends it must
hold only fields 2.0 knew: each frame is checked key by key against the
frames a 2.0 agent recorded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator

from crowdtrain.asgi import application
from crowdtrain_agent.protocol import PROTOCOL_MINOR, Lease, offered_subprotocols
from tests.factories import make_campaign, make_device, receipts_for

pytestmark = pytest.mark.django_db(transaction=True)

RECORDED = json.loads((Path(__file__).parents[2] / "protocol" / "fixtures" / "agent-2.0.json").read_text())


def fields_2_0_knows(frame: Any, recorded: Any, where: str = "") -> list[str]:
    """Keys of ``frame`` that the recorded 2.0 frame of the same kind lacks (its decoder refused those)."""
    if isinstance(frame, dict) and isinstance(recorded, dict):
        extra = [f"{where}.{k}" for k in frame if k not in recorded]
        for key in frame.keys() & recorded.keys():
            if key != "config":  # a model's config is free-form in both
                extra += fields_2_0_knows(frame[key], recorded[key], f"{where}.{key}")
        return extra
    if isinstance(frame, list) and isinstance(recorded, list) and recorded:
        return [e for item in frame for e in fields_2_0_knows(item, recorded[0], f"{where}[]")]
    return []


def filled(name: str, **values: Any) -> str:
    frame = dict(RECORDED["agent_sends"][name])
    frame.update({k: values[v[1:]] for k, v in frame.items() if isinstance(v, str) and v.startswith("$")})
    return json.dumps(frame)


async def received(communicator: WebsocketCommunicator) -> dict[str, Any]:
    frame = json.loads(await communicator.receive_from(timeout=5))
    extra = fields_2_0_knows(frame, RECORDED["agent_receives"][frame["kind"]], frame["kind"])
    assert extra == [], f"the site sent a 2.0 agent fields its decoder refuses: {extra}"
    return frame


async def test_a_2_0_agent_leases_reports_and_its_step_commits() -> None:
    await sync_to_async(make_campaign)(target_batch_size=8, microbatch_size=4)
    _, token = await sync_to_async(make_device)()
    communicator = WebsocketCommunicator(
        application, "/ws/agent/", headers=[(b"authorization", f"Bearer {token}".encode())]
    )
    connected, subprotocol = await communicator.connect()  # no subprotocol offered: a 2.0 agent
    assert connected and subprotocol is None
    try:
        await communicator.send_to(text_data=filled("hello"))
        assert (await received(communicator))["kind"] == "welcome"
        await communicator.send_to(text_data=filled("heartbeat"))

        acks = []
        for _ in range(2):  # each lease fills a step: two steps commit
            await communicator.send_to(text_data=filled("lease_request"))
            lease = msgspec.convert(await received(communicator), Lease)
            receipts = [msgspec.to_builtins(r) for r in await sync_to_async(receipts_for)(lease.lease_id)]
            await communicator.send_to(
                text_data=filled("done", lease_id=lease.lease_id, receipts=receipts, num_samples=lease.num_samples)
            )
            acks.append(await received(communicator))
        await communicator.send_to(text_data=filled("lease_request"))
        third = await received(communicator)
        await communicator.send_to(text_data=filled("release", lease_id=third["lease_id"]))
        released = await received(communicator)
    finally:
        await communicator.disconnect()

    assert [(a["kind"], a["accepted"], a["step"]) for a in acks] == [("done_ack", True, 0), ("done_ack", True, 1)]
    assert released == {"kind": "release_ack", "lease_id": third["lease_id"]}


async def test_an_agent_of_this_minor_is_answered_in_it() -> None:
    _, token = await sync_to_async(make_device)()
    communicator = WebsocketCommunicator(
        application,
        "/ws/agent/",
        headers=[(b"authorization", f"Bearer {token}".encode())],
        subprotocols=offered_subprotocols(),
    )
    connected, subprotocol = await communicator.connect()
    await communicator.disconnect()

    assert connected and subprotocol == f"crowdtrain.2.{PROTOCOL_MINOR}"
