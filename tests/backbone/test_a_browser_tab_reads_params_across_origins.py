"""A browser tab's page is the site's origin, its parameters the aggregator's: /params/ answers CORS, errors too.

Without ``Access-Control-Allow-Origin`` a browser hides an answer from the
page, which then sees "failed to fetch" where the aggregator said "version
dropped" (410) or "send a lease's ticket" (401); without the exposed headers
it cannot read the checksum or whether the body is a delta; without
``Cross-Origin-Resource-Policy`` a page isolated for wasm threads (COEP)
cannot load it at all.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

from crowdtrain_agent import deltas
from crowdtrain_agent.protocol import SliceReady
from crowdtrain_backbone import http_routes
from crowdtrain_backbone.server import BackboneServer

from .conftest import Agent, FakeSite, take_step, ticket

PAGE = "https://crowdtrain.example"  # the site's origin, where the tab's page is
EXPOSED = ["ETag", "Content-Range", "X-Crowdtrain-Version", deltas.CHECKSUM_HEADER, deltas.DELTA_FROM_HEADER,
           deltas.ENCODING_HEADER]  # fmt: skip


async def _request(url: str, method: str = "GET", **headers: str) -> tuple[int, dict[str, str], bytes]:
    def fetch() -> tuple[int, dict[str, str], bytes]:
        request = urllib.request.Request(url, method=method, headers={"Origin": PAGE, **headers})
        try:
            with urllib.request.urlopen(request, timeout=10) as resp:
                return resp.status, dict(resp.headers), resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), exc.read()

    return await asyncio.to_thread(fetch)


def _readable_by_a_tab(headers: dict[str, str]) -> None:
    assert headers["Access-Control-Allow-Origin"] == "*"
    exposed = [name.strip() for name in headers["Access-Control-Expose-Headers"].split(",")]
    assert exposed == EXPOSED
    assert headers["Cross-Origin-Resource-Policy"] == "cross-origin"


async def test_a_preflight_allows_the_ticket_a_held_etag_and_a_range(
    held: SliceReady, backbone: BackboneServer
) -> None:
    status, headers, body = await _request(
        f"{backbone.url}/params/1/0/0", "OPTIONS",
        **{"Access-Control-Request-Method": "GET", "Access-Control-Request-Headers": "authorization, range"},
    )  # fmt: skip

    assert status == 204 and body == b""
    assert headers["Access-Control-Allow-Methods"] == "GET"
    assert headers["Access-Control-Allow-Headers"] == "Authorization, If-None-Match, Range"
    assert int(headers["Access-Control-Max-Age"]) > 0
    _readable_by_a_tab(headers)


async def test_parameters_a_part_of_them_and_a_delta_are_readable_by_a_tab(
    site: FakeSite, held: SliceReady, backbone: BackboneServer, agent: Agent
) -> None:
    await take_step(site, agent, version=0, lease_id=1)
    auth = {"Authorization": f"Bearer {ticket(9)}"}

    whole = await _request(f"{backbone.url}/params/1/0/1", **auth)
    part = await _request(f"{backbone.url}/params/1/0/1", **auth, Range="bytes=0-15")
    unchanged = await _request(f"{backbone.url}/params/1/0/1", **auth, **{"If-None-Match": whole[1]["ETag"]})
    delta = await _request(f"{backbone.url}/params/1/0/1?from=0", **auth)

    assert (whole[0], part[0], unchanged[0], delta[0]) == (200, 206, 304, 200)
    for _, headers, _ in (whole, part, unchanged, delta):
        _readable_by_a_tab(headers)
    assert part[1]["Content-Range"].startswith("bytes 0-15/")


async def test_refusals_are_readable_by_a_tab_too(
    site: FakeSite, held: SliceReady, backbone: BackboneServer, agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http_routes, "PARAMS_WAIT_S", 0.2)
    for version in range(3):  # staleness 1 keeps 3 versions: 0 is dropped
        await take_step(site, agent, version=version, lease_id=version + 1)
    auth = {"Authorization": f"Bearer {ticket(9)}"}

    no_ticket = await _request(f"{backbone.url}/params/1/0/1")
    not_held = await _request(f"{backbone.url}/params/1/5/1", **auth)
    dropped = await _request(f"{backbone.url}/params/1/0/0", **auth)
    bad_from = await _request(f"{backbone.url}/params/1/0/1?from=x", **auth)
    posted = await _request(f"{backbone.url}/params/1/0/1", "POST", **auth)

    assert [r[0] for r in (no_ticket, not_held, dropped, bad_from, posted)] == [401, 404, 410, 400, 405]
    assert json.loads(dropped[2]) == {"error": "version dropped"}
    for _, headers, _ in (no_ticket, not_held, dropped, bad_from, posted):
        _readable_by_a_tab(headers)


async def test_nothing_but_params_answers_cors(held: SliceReady, backbone: BackboneServer) -> None:
    health = await _request(f"{backbone.url}/healthz")
    preflight = await _request(f"{backbone.url}/healthz", "OPTIONS", **{"Access-Control-Request-Method": "GET"})
    unknown = await _request(f"{backbone.url}/params/1/0/x", "OPTIONS", **{"Access-Control-Request-Method": "GET"})

    assert health[0] == 200 and "Access-Control-Allow-Origin" not in health[1]
    assert preflight[0] == 405 and "Access-Control-Allow-Origin" not in preflight[1]
    assert unknown[0] == 404 and "Access-Control-Allow-Methods" not in unknown[1]
