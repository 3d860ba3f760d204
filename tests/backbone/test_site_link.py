"""The link to the site: hello and heartbeats, reconnects with backoff (refused tokens: a file of their own)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from crowdtrain_agent.protocol import CloseCode, SliceReady
from crowdtrain_backbone.server import BackboneServer

from .conftest import FakeSite, assignment, running_backbone


async def test_it_says_hello_and_sends_heartbeats(site: FakeSite, backbone: BackboneServer) -> None:
    await asyncio.sleep(0.5)  # the fake site asks for a heartbeat every 0.2 s

    assert site.hello is not None and site.hello.name == "agg-test"
    assert site.hello.params_url == f"http://127.0.0.1:{backbone.port}/params/"
    assert site.heartbeats >= 2


async def test_it_reconnects_and_keeps_its_slices(
    site: FakeSite, held: SliceReady, backbone: BackboneServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="crowdtrain_backbone")
    assert site.ws is not None

    await site.ws.close(CloseCode.GOING_AWAY)
    await asyncio.sleep(0.05)
    await asyncio.wait_for(site.connected.wait(), 5)
    ready = await site.assign(assignment())  # the site re-sends what it assigned

    assert site.connections == 2
    assert ready.version == 0
    assert "reconnected to the site after 1 tries" in caplog.text


async def test_it_retries_a_site_that_is_down_until_it_comes_up(site: FakeSite, tmp_path: Path) -> None:
    site.close_with = 1011  # an unwelcoming but retryable site

    async with running_backbone_later(site, tmp_path):
        assert site.connections >= 2


class running_backbone_later:  # noqa: N801  (used like a function)
    """Start an aggregator while the site refuses, then let the site accept."""

    def __init__(self, site: FakeSite, tmp_path: Path) -> None:
        self.site = site
        self.cm = running_backbone(site, tmp_path)

    async def __aenter__(self) -> BackboneServer:
        async def open_later() -> None:
            while self.site.connections < 2:
                await asyncio.sleep(0.01)
            self.site.close_with = None

        opener = asyncio.create_task(open_later())
        server = await self.cm.__aenter__()
        await opener
        return server

    async def __aexit__(self, *exc: object) -> None:
        await self.cm.__aexit__(None, None, None)
