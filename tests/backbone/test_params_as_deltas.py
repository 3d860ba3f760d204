"""GET /params/...?from=<held>: a delta from a kept version, fp32 otherwise, and a checksum always."""

from __future__ import annotations

import asyncio
import hashlib
import json

import pytest

from crowdtrain_agent.codec import decode_fp32, encode_fp32
from crowdtrain_agent.deltas import ENCODING, decode_delta
from crowdtrain_agent.protocol import SliceReady
from crowdtrain_backbone import downloads
from crowdtrain_backbone.server import BackboneServer

from .conftest import SLICE0, Agent, FakeSite, take_step
from .test_params_http import _get

NUMEL = SLICE0[1] - SLICE0[0]


def _exact(backbone: BackboneServer) -> bytes:
    return encode_fp32(backbone.node.get_slice(1, 0).param.detach())


async def test_it_sends_a_delta_from_a_version_the_caller_holds(
    site: FakeSite, held: SliceReady, backbone: BackboneServer, agent: Agent
) -> None:
    _, _, version0 = await _get(f"{backbone.url}/params/1/0/0")
    await take_step(site, agent, version=0, lease_id=1)

    status, headers, body = await _get(f"{backbone.url}/params/1/0/1?from=0")

    assert status == 200
    assert headers["X-Crowdtrain-Delta-From"] == "0" and headers["X-Crowdtrain-Delta-Encoding"] == ENCODING
    assert decode_delta(body, version0) == _exact(backbone)
    assert headers["X-Crowdtrain-Sha256"] == hashlib.sha256(_exact(backbone)).hexdigest()
    assert headers["X-Crowdtrain-Version"] == "1" and headers["ETag"] == backbone.node.get_slice(1, 0).snapshots[1].etag


async def test_a_full_download_carries_the_checksum_of_the_exact_bytes(
    site: FakeSite, held: SliceReady, backbone: BackboneServer, agent: Agent
) -> None:
    await take_step(site, agent, version=0, lease_id=1)

    status, headers, body = await _get(f"{backbone.url}/params/1/0/1")

    assert status == 200 and "X-Crowdtrain-Delta-From" not in headers
    assert body == _exact(backbone) and len(body) == 4 * NUMEL
    assert headers["X-Crowdtrain-Sha256"] == hashlib.sha256(body).hexdigest()


async def test_a_version_not_kept_or_not_below_the_wanted_one_gets_the_full_body(
    site: FakeSite, held: SliceReady, backbone: BackboneServer, agent: Agent
) -> None:
    for version in range(3):  # staleness 1 keeps 3 versions: 1, 2, 3
        await take_step(site, agent, version=version, lease_id=version + 1)
    url = f"{backbone.url}/params/1/0/3"

    answers = [await _get(f"{url}?from={held}") for held in ("0", "3", "5", "9" * 30)]

    for status, headers, body in answers:
        assert status == 200 and "X-Crowdtrain-Delta-From" not in headers
        assert decode_fp32(body, NUMEL).equal(backbone.node.get_slice(1, 0).param.detach())
        assert headers["X-Crowdtrain-Sha256"] == hashlib.sha256(body).hexdigest()


async def test_a_malformed_from_is_answered_400_naming_it(held: SliceReady, backbone: BackboneServer) -> None:
    url = f"{backbone.url}/params/1/0/0"

    answers = [await _get(f"{url}?from={held}") for held in ("abc", "-1", "", "1.0", "0&from=0", "%D9%A3")]

    for status, _, body in answers:
        assert status == 400
        assert json.loads(body) == {"error": "from must be the version number you hold, digits only, once"}


async def test_each_delta_is_encoded_once_for_every_agent_that_asks(
    site: FakeSite, held: SliceReady, backbone: BackboneServer, agent: Agent
) -> None:
    await take_step(site, agent, version=0, lease_id=1)
    cache = backbone.node.get_slice(1, 0).downloads

    answers = await asyncio.gather(*(_get(f"{backbone.url}/params/1/0/1?from=0") for _ in range(5)))

    assert {body for _, _, body in answers} == {answers[0][2]}
    assert cache.deltas_computed == 1


async def test_a_delta_waits_for_the_version_being_applied(
    site: FakeSite, held: SliceReady, backbone: BackboneServer, agent: Agent
) -> None:
    _, _, version0 = await _get(f"{backbone.url}/params/1/0/0")
    download = asyncio.create_task(_get(f"{backbone.url}/params/1/0/1?from=0"))
    await asyncio.sleep(0.3)
    waited = not download.done()

    await take_step(site, agent, version=0, lease_id=1)
    status, headers, body = await asyncio.wait_for(download, 5)

    assert waited
    assert status == 200 and headers["X-Crowdtrain-Delta-From"] == "0"
    assert decode_delta(body, version0) == _exact(backbone)


async def test_deltas_of_versions_no_longer_kept_are_forgotten(
    site: FakeSite, held: SliceReady, backbone: BackboneServer, agent: Agent
) -> None:
    await take_step(site, agent, version=0, lease_id=1)
    await _get(f"{backbone.url}/params/1/0/1?from=0")
    state = backbone.node.get_slice(1, 0)
    assert len(state.downloads._deltas) == 1

    for version in range(1, 4):  # version 0 falls out of the window
        await take_step(site, agent, version=version, lease_id=version + 1)

    assert 0 not in state.snapshots and len(state.downloads._deltas) == 0
    assert set(state.downloads._checksums) <= {s.etag for s in state.snapshots.values()}


async def test_a_delta_no_smaller_than_fp32_is_not_sent(
    site: FakeSite, held: SliceReady, backbone: BackboneServer, agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Parameters that look random compress to nothing less than their fp32 bytes: those go as they are.
    monkeypatch.setattr(downloads, "encode_delta", lambda wanted, held: b"\0" * len(wanted))
    monkeypatch.setattr(downloads, "write_delta", lambda wanted, held, out, read: out.write(b"\0" * len(wanted)))
    await take_step(site, agent, version=0, lease_id=1)

    status, headers, body = await _get(f"{backbone.url}/params/1/0/1?from=0")

    assert status == 200 and "X-Crowdtrain-Delta-From" not in headers
    assert body == _exact(backbone)
