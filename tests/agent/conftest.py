"""Fixtures for agent tests: a fake site and two fake aggregators on loopback, and an agent config for them."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from crowdtrain_agent.config import AgentConfig
from crowdtrain_agent.control import Backoff

from .fakes import GOOD_TOKEN, World, make_world

FAST_BACKOFF = Backoff(base_s=0.05, max_s=0.2, max_tries=5)


@pytest.fixture
async def world() -> AsyncIterator[World]:
    w = await make_world()
    yield w
    await w.site.stop()
    for agg in w.aggregators:
        await agg.stop()


@pytest.fixture
def config(world: World, tmp_path: Path) -> AgentConfig:
    return AgentConfig(
        server=world.site.url,
        token=GOOD_TOKEN,
        device="cpu",
        cache_dir=tmp_path / "cache",
        max_leases=2,
        progress=False,
    )


@pytest.fixture(autouse=True)
def isolated_user_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Never read or write the real user's saved login or cache."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    for name in ("SERVER", "TOKEN", "DEVICE", "THREADS", "CACHE_DIR", "CAMPAIGN", "CONFIG"):
        monkeypatch.delenv(f"CROWDTRAIN_AGENT_{name}", raising=False)
    yield
    root = logging.getLogger()
    for handler in [h for h in root.handlers if h.get_name() == "crowdtrain-agent"]:
        root.removeHandler(handler)  # installed by cli.main in CLI tests
    logging.getLogger("crowdtrain_agent").setLevel(logging.NOTSET)
