"""Every bad upload is rejected with a clear code, and the connection and pending state survive it."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from websockets.exceptions import ConnectionClosed

from crowdtrain_agent.codec import get_codec
from crowdtrain_agent.protocol import (
    MAX_WS_MESSAGE_BYTES,
    SliceReady,
    UploadBegin,
    UploadReceipt,
    UploadRejected,
    encode_chunk,
    encode_message,
)
from crowdtrain_backbone.server import BackboneServer

from .conftest import KEY, SLICE0, Agent, FakeSite, agent_connection, assignment, gradient, take_step, ticket

NUMEL = SLICE0[1] - SLICE0[0]


async def _assert_rejected_then_usable(agent: Agent, backbone: BackboneServer, reply: object, code: str,
                                       text: str = "", *, version: int = 0) -> None:  # fmt: skip
    assert isinstance(reply, UploadRejected), reply
    assert reply.code == code, reply
    assert text in reply.detail
    pending_before = set(backbone.node.get_slice(1, 0).pending)

    await agent.good_upload(lease_id=500, base_version=version)

    assert set(backbone.node.get_slice(1, 0).pending) == pending_before | {500}


async def test_it_rejects_malformed_json(held: SliceReady, agent: Agent, backbone: BackboneServer) -> None:
    await agent.good_upload(lease_id=1)

    await agent.ws.send("{not json")

    await _assert_rejected_then_usable(agent, backbone, await agent.reply(), "malformed json")
    assert set(backbone.node.get_slice(1, 0).pending) == {1, 500}


async def test_it_rejects_an_unknown_message_kind(held: SliceReady, agent: Agent, backbone: BackboneServer) -> None:
    await agent.ws.send(json.dumps({"kind": "gimme_params"}))

    await _assert_rejected_then_usable(agent, backbone, await agent.reply(), "unknown message", "gimme_params")


async def test_it_rejects_a_header_with_a_missing_field(
    held: SliceReady, agent: Agent, backbone: BackboneServer
) -> None:
    await agent.ws.send(json.dumps({"kind": "upload", "ticket": ticket(1), "slice_index": 0, "codec": "fp32"}))

    await _assert_rejected_then_usable(agent, backbone, await agent.reply(), "malformed message", "num_elements")


async def test_it_closes_on_a_binary_frame_over_the_limit_and_serves_the_next_connection(
    held: SliceReady, agent: Agent, backbone: BackboneServer
) -> None:
    await agent.good_upload(lease_id=1)
    await agent.ws.send(encode_message(UploadBegin(ticket=ticket(2), slice_index=0, codec="fp32",
                                                   num_elements=NUMEL, num_chunks=1)))  # fmt: skip

    await agent.ws.send(b"\0" * (MAX_WS_MESSAGE_BYTES + 1))

    with pytest.raises(ConnectionClosed) as closed:
        await agent.reply()
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009  # message too big
    async with agent_connection(backbone) as fresh:
        await fresh.good_upload(lease_id=2)  # lease 2 was never taken: its reservation was given back
    assert set(backbone.node.get_slice(1, 0).pending) == {1, 2}
    assert backbone.node.budget.used == 2 * NUMEL * 4


async def test_it_closes_on_a_broken_chunk_header(held: SliceReady, agent: Agent, backbone: BackboneServer) -> None:
    await agent.ws.send(encode_message(UploadBegin(ticket=ticket(2), slice_index=0, codec="fp32",
                                                   num_elements=NUMEL, num_chunks=1)))  # fmt: skip

    await agent.ws.send(b"JUNK" + bytes(NUMEL * 4 + 12))

    with pytest.raises(ConnectionClosed) as closed:
        await agent.reply()
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4000
    async with agent_connection(backbone) as fresh:
        await fresh.good_upload(lease_id=2)


async def test_it_closes_on_a_binary_frame_with_no_upload_announced(
    held: SliceReady, agent: Agent, backbone: BackboneServer
) -> None:
    await agent.ws.send(encode_chunk(0, 1, bytes(16)))

    with pytest.raises(ConnectionClosed) as closed:
        await agent.reply()
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4000


async def test_it_rejects_a_wrong_chunk_count(held: SliceReady, agent: Agent, backbone: BackboneServer) -> None:
    reply = await agent.upload(ticket(1), gradient(NUMEL, 1), num_chunks=2)

    await _assert_rejected_then_usable(agent, backbone, reply, "wrong chunk count", "announces 2")
    assert 1 not in backbone.node.get_slice(1, 0).pending


async def test_it_rejects_chunks_out_of_order(site: FakeSite, backbone: BackboneServer, agent: Agent) -> None:
    from .conftest import assignment

    big = {"in_dim": 512, "hidden": [256], "classes": 10}  # 133,898 params: two fp32 chunks
    from crowdtrain_agent.protocol import ModelSpec

    await site.assign(assignment(campaign_id=2, bounds=(0, 133_898), param_count=133_898,
                                 model=ModelSpec(architecture="mlp", config=big)))  # fmt: skip
    await site.assign(assignment())
    payload = gradient(133_898, 1).numpy().astype("<f4").tobytes()
    half = 512 << 10
    await agent.ws.send(encode_message(UploadBegin(ticket=ticket(1, campaign_id=2), slice_index=0, codec="fp32",
                                                   num_elements=133_898, num_chunks=2)))  # fmt: skip

    await agent.ws.send(encode_chunk(1, 2, payload[half:]))
    await agent.ws.send(encode_chunk(0, 2, payload[:half]))

    await _assert_rejected_then_usable(agent, backbone, await agent.reply(), "wrong chunk count", "in order")
    assert backbone.node.get_slice(2, 0).pending == {}


async def test_it_rejects_a_wrong_number_of_elements(held: SliceReady, agent: Agent, backbone: BackboneServer) -> None:
    reply = await agent.upload(ticket(1), gradient(NUMEL + 1, 1))

    await _assert_rejected_then_usable(agent, backbone, reply, "wrong shape", f"has {NUMEL} elements")


async def test_it_rejects_an_unknown_codec(held: SliceReady, agent: Agent, backbone: BackboneServer) -> None:
    reply = await agent.upload(ticket(1), gradient(NUMEL, 1), codec="int4")

    await _assert_rejected_then_usable(agent, backbone, reply, "unknown codec", "int4")


@pytest.mark.parametrize(("value", "codec"), [(float("nan"), "fp32"), (float("inf"), "fp32"), (1e6, "fp16")])
async def test_it_rejects_values_that_are_not_finite(
    held: SliceReady, agent: Agent, backbone: BackboneServer, value: float, codec: str
) -> None:
    grad = gradient(NUMEL, 1)
    grad[7] = value  # 1e6 overflows fp16 to inf

    reply = await agent.upload(ticket(1), grad, codec=codec)

    await _assert_rejected_then_usable(agent, backbone, reply, "not finite", "NaN or infinite")
    assert backbone.node.budget.used == NUMEL * 4  # only lease 500's reservation is held


async def test_it_accepts_fp16_uploads(held: SliceReady, agent: Agent, backbone: BackboneServer) -> None:
    grad = gradient(NUMEL, 1)

    await agent.upload(ticket(1), grad, codec="fp16")

    torch.testing.assert_close(backbone.node.get_slice(1, 0).pending[1].grad, grad.half().float(), rtol=0, atol=0)


async def test_it_accepts_int8_uploads(site: FakeSite, agent: Agent, backbone: BackboneServer) -> None:
    await site.assign(assignment(codec="int8", codec_block_size=32))
    grad = gradient(NUMEL, 1)  # 40 elements: a block of 32 and one of 8

    reply = await agent.upload(ticket(1), grad, codec="int8", codec_block_size=32)

    assert isinstance(reply, UploadReceipt), reply
    pending = backbone.node.get_slice(1, 0).pending[1].grad
    torch.testing.assert_close(pending, get_codec("int8", 32).decode(get_codec("int8", 32).encode(grad), NUMEL))
    assert (pending - grad).abs().max() <= grad.abs().max() / 254 * (1 + 1e-6)
    assert backbone.node.metrics.ingest_bytes._value.get() == NUMEL + 2 * 4  # a byte per value, a scale per block


def _int8_payload(scale: float | None = None, *, value: int | None = None, cut: int = 0) -> bytes:
    payload = bytearray(get_codec("int8", 32).encode(gradient(NUMEL, 1)))
    if scale is not None:
        payload[4:8] = struct.pack("<f", scale)  # the second block's
    if value is not None:
        payload[-1] = value
    return bytes(payload[: len(payload) - cut])


@pytest.mark.parametrize(
    ("payload", "code", "text"),
    [
        (_int8_payload(float("nan")), "bad payload", "the scale of block 1 is nan"),
        (_int8_payload(float("inf")), "bad payload", "the scale of block 1 is inf"),
        (_int8_payload(-0.5), "bad payload", "the scale of block 1 is -0.5"),
        (_int8_payload(value=0x80), "bad payload", "a value is -128"),
        (_int8_payload(3e38), "not finite", "NaN or infinite"),  # 127 * 3e38 overflows float32
        (_int8_payload(cut=1), "wrong chunk size", "carries 47 bytes, expected 48"),
    ],
    ids=["nan scale", "inf scale", "negative scale", "-128", "overflow", "truncated"],
)
async def test_it_rejects_int8_bytes_no_encoder_writes(
    site: FakeSite, agent: Agent, backbone: BackboneServer, payload: bytes, code: str, text: str
) -> None:
    await site.assign(assignment(codec="int8", codec_block_size=32))

    reply = await agent.upload(ticket(1), gradient(NUMEL, 1), codec="int8", codec_block_size=32, payload=payload)

    await _assert_rejected_then_usable_int8(agent, backbone, reply, code, text)
    assert backbone.node.budget.used == NUMEL * 4  # only the good upload's reservation is held


async def test_it_rejects_int8_in_other_blocks_than_the_campaigns(
    site: FakeSite, agent: Agent, backbone: BackboneServer
) -> None:
    await site.assign(assignment(codec="int8", codec_block_size=32))

    reply = await agent.upload(ticket(1), gradient(NUMEL, 1), codec="int8", codec_block_size=64)

    await _assert_rejected_then_usable_int8(agent, backbone, reply, "wrong codec", "in blocks of 32")


async def _assert_rejected_then_usable_int8(
    agent: Agent, backbone: BackboneServer, reply: object, code: str, text: str
) -> None:
    assert isinstance(reply, UploadRejected), reply
    assert (reply.code, reply.lease_id) == (code, 1), reply
    assert text in reply.detail, reply.detail
    good = await agent.upload(ticket(500), gradient(NUMEL, 500), codec="int8", codec_block_size=32)
    assert isinstance(good, UploadReceipt), good
    assert set(backbone.node.get_slice(1, 0).pending) == {500}


async def test_it_rejects_a_forged_ticket(held: SliceReady, agent: Agent, backbone: BackboneServer) -> None:
    reply = await agent.upload(ticket(1, key=b"not the site's key"), gradient(NUMEL, 1))

    await _assert_rejected_then_usable(agent, backbone, reply, "bad ticket", "signature does not verify")


async def test_it_rejects_an_expired_ticket(held: SliceReady, agent: Agent, backbone: BackboneServer) -> None:
    reply = await agent.upload(ticket(1, expires_in=-1), gradient(NUMEL, 1))

    await _assert_rejected_then_usable(agent, backbone, reply, "bad ticket", "expired")


@pytest.mark.parametrize(("campaign_id", "slice_index"), [(99, 0), (1, 5)])
async def test_it_rejects_a_ticket_for_a_slice_it_does_not_hold(
    held: SliceReady, agent: Agent, backbone: BackboneServer, campaign_id: int, slice_index: int
) -> None:
    reply = await agent.upload(ticket(1, campaign_id=campaign_id), gradient(NUMEL, 1), slice_index=slice_index)

    await _assert_rejected_then_usable(agent, backbone, reply, "slice not held", f"campaign {campaign_id}")


async def test_it_rejects_replayed_upload(held: SliceReady, agent: Agent, backbone: BackboneServer) -> None:
    await agent.good_upload(lease_id=1)

    reply = await agent.upload(ticket(1), gradient(NUMEL, 2))

    await _assert_rejected_then_usable(agent, backbone, reply, "replayed upload", "lease 1")
    torch.testing.assert_close(backbone.node.get_slice(1, 0).pending[1].grad, gradient(NUMEL, 1))


async def test_it_rejects_a_replay_of_a_committed_lease(site: FakeSite, held: SliceReady, agent: Agent,
                                                        backbone: BackboneServer) -> None:  # fmt: skip
    await take_step(site, agent, version=0, lease_id=1)

    reply = await agent.upload(ticket(1, base_version=1), gradient(NUMEL, 1))

    await _assert_rejected_then_usable(agent, backbone, reply, "replayed upload", "committed", version=1)


async def test_it_rejects_versions_outside_the_window(site: FakeSite, held: SliceReady, agent: Agent,
                                                      backbone: BackboneServer) -> None:  # fmt: skip
    await take_step(site, agent, version=0, lease_id=1)
    await take_step(site, agent, version=1, lease_id=2)  # now at version 2, staleness 1: accepts 1..2

    stale = await agent.upload(ticket(3, base_version=0), gradient(NUMEL, 3))
    future = await agent.upload(ticket(4, base_version=3), gradient(NUMEL, 4))
    in_window = await agent.upload(ticket(5, base_version=1), gradient(NUMEL, 5))

    assert isinstance(stale, UploadRejected) and stale.code == "stale version" and "accepts 1..2" in stale.detail
    assert isinstance(future, UploadRejected) and future.code == "future version"
    assert not isinstance(in_window, UploadRejected)
    await _assert_rejected_then_usable(agent, backbone, stale, "stale version", version=2)


async def test_it_rejects_a_gradient_over_the_norm_bound(
    site: FakeSite, backbone: BackboneServer, agent: Agent
) -> None:
    from .conftest import assignment

    await site.assign(assignment(max_grad_norm=2.0))
    grad = torch.full((NUMEL,), 10.0)  # norm 63.2 over 4 samples: 15.8 per sample

    reply = await agent.upload(ticket(1, num_samples=4), grad)
    small = await agent.upload(ticket(2, num_samples=4), grad / 100)

    assert not isinstance(small, UploadRejected)
    await _assert_rejected_then_usable(agent, backbone, reply, "norm bound", "15.8")


async def test_it_answers_busy_when_pending_memory_is_full(site: FakeSite, tmp_path: object) -> None:
    from pathlib import Path

    from .conftest import assignment, running_backbone

    async with running_backbone(site, Path(str(tmp_path)), max_pending_bytes=2 * NUMEL * 4) as backbone:
        await site.assign(assignment())
        async with agent_connection(backbone) as agent:
            await agent.good_upload(lease_id=1)
            await agent.good_upload(lease_id=2)

            reply = await agent.upload(ticket(3), gradient(NUMEL, 3))
            await site.commit(0, [1, 2], 8)

            assert isinstance(reply, UploadRejected) and reply.code == "busy"
            await agent.good_upload(lease_id=4, base_version=1)  # the step freed the memory


async def test_it_does_not_disturb_other_connections(held: SliceReady, agent: Agent, backbone: BackboneServer) -> None:
    async with agent_connection(backbone) as other:
        await other.ws.send(encode_message(UploadBegin(ticket=ticket(2), slice_index=0, codec="fp32",
                                                       num_elements=NUMEL, num_chunks=1)))  # fmt: skip
        # other is mid-upload; a bad upload on this connection must not affect it
        bad = await agent.upload(ticket(3, key=KEY + b"x"), gradient(NUMEL, 3))
        payload = gradient(NUMEL, 2).numpy().astype("<f4").tobytes()
        await other.ws.send(encode_chunk(0, 1, payload))

        good = await other.reply()

    assert isinstance(bad, UploadRejected) and bad.code == "bad ticket"
    assert not isinstance(good, UploadRejected)
    assert set(backbone.node.get_slice(1, 0).pending) == {2}
