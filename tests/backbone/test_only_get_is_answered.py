"""Every path on the aggregator's port takes GET only; anything else is refused in JSON, before any route runs."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

from crowdtrain_agent.protocol import SliceReady
from crowdtrain_backbone.server import BackboneServer

from .conftest import ticket


def _status(url: str, method: str) -> tuple[int, str, bytes]:
    request = urllib.request.Request(url, method=method, headers={"Authorization": f"Bearer {ticket(9)}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310 (loopback http only)
            return response.status, response.headers.get("Allow", ""), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Allow", ""), exc.read()


async def test_a_post_or_a_head_is_refused_with_405(held: SliceReady, backbone: BackboneServer) -> None:
    post = await asyncio.to_thread(_status, f"{backbone.url}/params/1/0/0", "POST")
    head = await asyncio.to_thread(_status, f"{backbone.url}/healthz", "HEAD")
    get = await asyncio.to_thread(_status, f"{backbone.url}/params/1/0/0", "GET")

    assert post[0] == 405 and post[1] == "GET" and "POST" in json.loads(post[2])["error"]
    assert head[0] == 405 and head[2] == b""
    assert get[0] == 200
