"""Close codes that no retry can fix stop the agent at once, with a hint for the volunteer."""

from __future__ import annotations

import asyncio
import gc
import logging
from pathlib import Path

import pytest

from crowdtrain_agent import cli
from crowdtrain_agent.protocol import CloseCode

from .fakes import World


async def _run_cli(world: World, tmp_path: Path, token: str) -> int:
    argv = ["run", "--server", world.site.url, "--token", token, "--device", "cpu", "--no-progress"]
    argv += ["--cache-dir", str(tmp_path)]
    return await asyncio.wait_for(asyncio.to_thread(cli.main, argv), 30)


async def test_bad_token_stops_without_reconnecting_and_says_to_log_in_again(
    world: World, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = await _run_cli(world, tmp_path, "wrong-token")

    assert code == cli.EXIT_STOPPED
    assert world.site.connections == 1
    err = capsys.readouterr().err
    assert "rejected this agent's token (close code 4001)" in err and "log in again" in err


async def test_revoked_device_stops_without_reconnecting_and_says_so(
    world: World, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    world.site.close_code = CloseCode.REVOKED

    code = await _run_cli(world, tmp_path, "good-token")

    assert code == cli.EXIT_STOPPED
    assert world.site.connections == 1
    assert "this device was revoked in the browser" in capsys.readouterr().err


async def test_a_fatal_close_leaves_no_task_failure_unread(
    world: World, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """asyncio logs an unread task failure whenever the garbage collector frees the task, inside whatever code
    runs then; once that was the middle of an ``ast.parse`` in another test, which it broke."""
    world.site.close_code = CloseCode.REVOKED

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        for _ in range(3):
            assert await _run_cli(world, tmp_path, "good-token") == cli.EXIT_STOPPED
            gc.collect()

    assert "never retrieved" not in caplog.text
