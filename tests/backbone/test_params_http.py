"""GET /params/<campaign>/<slice>/<version> and /healthz on the aggregator's port."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.error
import urllib.request

import pytest
import torch

from crowdtrain_agent.codec import decode_fp32
from crowdtrain_agent.protocol import SliceReady
from crowdtrain_backbone import http_routes
from crowdtrain_backbone.server import BackboneServer

from .conftest import SLICE0, Agent, FakeSite, take_step, ticket

NUMEL = SLICE0[1] - SLICE0[0]


async def _get(
    url: str, headers: dict[str, str] | None = None, *, token: str | None = "auto"
) -> tuple[int, dict[str, str], bytes]:
    """GET ``url``; with a lease's ticket for the campaign the URL names, unless ``token`` says otherwise."""
    headers = dict(headers or {})
    match = re.search(r"/params/(\d+)/", url)
    if token == "auto" and match:
        token = ticket(99, campaign_id=int(match.group(1)))
    if token and token != "auto":
        headers["Authorization"] = f"Bearer {token}"

    def fetch() -> tuple[int, dict[str, str], bytes]:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as resp:
                return resp.status, dict(resp.headers), resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), exc.read()

    return await asyncio.to_thread(fetch)


async def test_it_serves_the_params_of_a_version_as_fp32_bytes(
    site: FakeSite, held: SliceReady, backbone: BackboneServer, agent: Agent
) -> None:
    await take_step(site, agent, version=0, lease_id=1)

    status, headers, body = await _get(f"http://127.0.0.1:{backbone.port}/params/1/0/1")

    assert status == 200
    assert torch.equal(decode_fp32(body, NUMEL), backbone.node.get_slice(1, 0).param.detach())
    assert headers["Content-Type"] == "application/octet-stream"
    assert headers["Cache-Control"] == "private, max-age=31536000, immutable"
    assert headers["X-Crowdtrain-Version"] == "1"
    assert headers["ETag"].startswith('"') and len(body) == NUMEL * 4


async def test_the_params_url_announced_to_the_site_works(
    site: FakeSite, held: SliceReady, backbone: BackboneServer
) -> None:
    assert site.hello is not None
    assert site.hello.upload_url == f"ws://127.0.0.1:{backbone.port}/upload"

    status, _, body = await _get(f"{site.hello.params_url}1/0/0")

    assert status == 200 and len(body) == NUMEL * 4


async def test_it_answers_not_modified_for_a_matching_etag(held: SliceReady, backbone: BackboneServer) -> None:
    _, headers, _ = await _get(f"http://127.0.0.1:{backbone.port}/params/1/0/0")

    status, again, body = await _get(
        f"http://127.0.0.1:{backbone.port}/params/1/0/0", {"If-None-Match": headers["ETag"]}
    )

    assert status == 304 and body == b"" and again["ETag"] == headers["ETag"]


async def test_it_answers_404_for_an_unknown_version_or_slice(held: SliceReady, backbone: BackboneServer) -> None:
    ahead = await _get(f"http://127.0.0.1:{backbone.port}/params/1/0/7")
    other = await _get(f"http://127.0.0.1:{backbone.port}/params/9/0/0")
    junk = await _get(f"http://127.0.0.1:{backbone.port}/params/1/zero/0")

    assert ahead[0] == 404 and json.loads(ahead[2]) == {"error": "version not published yet"}
    assert other[0] == 404 and json.loads(other[2]) == {"error": "slice not held"}
    assert junk[0] == 404 and json.loads(junk[2]) == {"error": "not found"}


async def test_a_download_of_the_version_being_applied_is_answered_once_it_is_published(
    site: FakeSite, held: SliceReady, backbone: BackboneServer, agent: Agent
) -> None:
    download = asyncio.create_task(_get(f"http://127.0.0.1:{backbone.port}/params/1/0/1"))
    await asyncio.sleep(0.3)
    waited = not download.done()

    await take_step(site, agent, version=0, lease_id=1)
    status, headers, body = await asyncio.wait_for(download, 5)

    assert waited
    assert status == 200 and headers["X-Crowdtrain-Version"] == "1"
    assert torch.equal(decode_fp32(body, NUMEL), backbone.node.get_slice(1, 0).param.detach())


async def test_a_version_that_is_not_published_in_time_gets_a_404(
    held: SliceReady, backbone: BackboneServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http_routes, "PARAMS_WAIT_S", 0.2)

    status, _, body = await _get(f"http://127.0.0.1:{backbone.port}/params/1/0/1")

    assert status == 404 and json.loads(body) == {"error": "version not published yet"}


async def test_a_version_further_ahead_than_any_commit_in_flight_is_not_waited_for(
    held: SliceReady, backbone: BackboneServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http_routes, "PARAMS_WAIT_S", 60.0)  # past the 10 s client timeout, were it waited for

    status, _, body = await _get(f"http://127.0.0.1:{backbone.port}/params/1/0/7")

    assert status == 404 and json.loads(body) == {"error": "version not published yet"}


async def test_it_answers_410_for_a_version_it_no_longer_keeps(
    site: FakeSite, held: SliceReady, backbone: BackboneServer, agent: Agent
) -> None:
    for version in range(3):  # staleness 1 keeps 3 versions: 1, 2, 3
        await take_step(site, agent, version=version, lease_id=version + 1)

    gone = await _get(f"http://127.0.0.1:{backbone.port}/params/1/0/0")
    kept = await _get(f"http://127.0.0.1:{backbone.port}/params/1/0/1")

    assert gone[0] == 410 and json.loads(gone[2]) == {"error": "version dropped"}
    assert kept[0] == 200


async def test_parameters_go_only_to_holders_of_a_ticket_for_their_campaign(
    held: SliceReady, backbone: BackboneServer
) -> None:
    url = f"http://127.0.0.1:{backbone.port}/params/1/0/0"

    anonymous = await _get(url, token=None)
    other_campaign = await _get(url, token=ticket(5, campaign_id=2))
    expired = await _get(url, token=ticket(5, expires_in=-60))
    forged = await _get(url, token=ticket(5, key=b"not-the-site-key-0123456789abcdef"))
    ticketed = await _get(url)

    assert anonymous[0] == 401 and "Authorization: Bearer" in json.loads(anonymous[2])["error"]
    assert other_campaign[0] == 403 and json.loads(other_campaign[2]) == {"error": "the ticket is for campaign 2"}
    assert expired[0] == 403 and "expired" in json.loads(expired[2])["error"]
    assert forged[0] == 403
    assert ticketed[0] == 200 and len(ticketed[2]) == NUMEL * 4


async def test_healthz_shows_name_slices_and_versions(held: SliceReady, backbone: BackboneServer) -> None:
    status, headers, body = await _get(f"http://127.0.0.1:{backbone.port}/healthz")

    health = json.loads(body)
    assert status == 200 and headers["Content-Type"] == "application/json"
    assert health["name"] == "agg-test" and health["aggregator_id"] == 7
    assert health["slices"][0] | {"pending_leases": []} == {
        "campaign_id": 1, "slice_index": 0, "start": 0, "end": 40, "version": 0, "versions": [0], "pending_leases": [],
        "aggregation": "mean", "clipped": 0,
    }  # fmt: skip


async def test_an_agent_sees_that_a_version_it_holds_was_published_again_after_a_rollback(
    site: FakeSite, held: SliceReady, backbone: BackboneServer, agent: Agent
) -> None:
    from crowdtrain_agent.fetch import fetch_params, still_current
    from crowdtrain_agent.protocol import Rollback, SliceRoute

    await take_step(site, agent, version=0, lease_id=1)
    route = SliceRoute(index=0, start=SLICE0[0], end=SLICE0[1], upload_url="ws://unused",
                       params_url=f"{backbone.url}/params/1/0/")  # fmt: skip
    lease_ticket = ticket(2, campaign_id=1)
    etags: list[str] = []
    await asyncio.to_thread(fetch_params, [route], 1, NUMEL, ticket=lease_ticket, etags=etags)

    assert await asyncio.to_thread(still_current, [route], 1, etags, ticket=lease_ticket)  # a 304, no body
    # Version 1 is made again from other gradients (a rollback to 0, then another step 0).
    await site.call(Rollback(campaign_id=1, version=0), SliceReady)
    await take_step(site, agent, version=0, lease_id=3)

    assert not await asyncio.to_thread(still_current, [route], 1, etags, ticket=lease_ticket)
    assert not await asyncio.to_thread(still_current, [route], 1, [], ticket=lease_ticket)  # nothing held
