"""A close code no retry can fix stops the aggregator with a hint; an HTTP refusal of the handshake is retried.

The site accepts every socket and refuses a token with close code 4001. An
HTTP 403 means a daphne too busy to accept in time, and an aggregator that
quit on it left a busy site without its slices.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path

import pytest

from crowdtrain_agent.protocol import CloseCode
from crowdtrain_backbone.server import BackboneServer
from crowdtrain_backbone.site_link import SiteRefused

from .conftest import FAST_BACKOFF, FakeSite, backbone_config, running_backbone

ROOT = Path(__file__).resolve().parents[2]


async def test_an_unknown_token_stops_the_link_with_what_to_do(site: FakeSite, tmp_path: Path) -> None:
    site.close_with = int(CloseCode.UNAUTHORIZED)
    server = BackboneServer(backbone_config(site.url, tmp_path), backoff=FAST_BACKOFF)
    await server.start()

    with pytest.raises(SiteRefused) as refused:
        await asyncio.wait_for(server.wait(), 5)

    await server.stop()
    assert site.connections == 1
    assert "close code 4001" in str(refused.value)
    assert "manage.py create_backbone_token --name agg-test" in str(refused.value)
    assert "--token or CROWDTRAIN_BACKBONE_TOKEN" in str(refused.value)


async def test_a_newer_process_on_the_same_token_stops_the_older_with_what_to_do(
    site: FakeSite, tmp_path: Path
) -> None:
    site.close_with = int(CloseCode.REPLACED)
    server = BackboneServer(backbone_config(site.url, tmp_path), backoff=FAST_BACKOFF)
    await server.start()

    with pytest.raises(SiteRefused, match="Run one process per token"):
        await asyncio.wait_for(server.wait(), 5)

    await server.stop()


@pytest.mark.parametrize("statuses", [[403], [401, 503, 502]])
async def test_http_refusals_of_the_handshake_are_retried(
    site: FakeSite, tmp_path: Path, statuses: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="crowdtrain_backbone")
    site.refuse_handshakes = list(statuses)

    async with running_backbone(site, tmp_path):  # waits until the site welcomed it
        pass

    assert site.refused == len(statuses) and site.connections == 1
    assert f"HTTP {statuses[0]}" in caplog.text and "busy or unreachable" in caplog.text


async def test_the_command_exits_with_status_1_and_the_hint(site: FakeSite, tmp_path: Path) -> None:
    site.close_with = int(CloseCode.UNAUTHORIZED)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CROWDTRAIN_BACKBONE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "platform"), str(ROOT / "agent" / "src")])
    command = [sys.executable, "-m", "crowdtrain_backbone", "--site", site.url, "--token", "t", "--name", "agg-cli",
               "--port", "0", "--checkpoint-dir", str(tmp_path)]  # fmt: skip

    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env
    )
    _, stderr = await asyncio.wait_for(process.communicate(), 60)

    assert process.returncode == 1
    assert "crowdtrain-backbone: the site at" in stderr.decode()
    assert "create_backbone_token --name agg-cli" in stderr.decode()
