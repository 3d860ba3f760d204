"""Compute runs off the event loop, so heartbeats keep flowing during a long lease."""

from __future__ import annotations

import time
from typing import Any

import pytest

from crowdtrain_agent import trainer
from crowdtrain_agent.config import AgentConfig
from crowdtrain_agent.protocol import LeaseDone
from crowdtrain_agent.runtime import Agent

from .conftest import FAST_BACKOFF
from .fakes import World


async def test_heartbeats_keep_flowing_while_compute_runs(
    world: World, config: AgentConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    window: list[float] = []
    real = trainer.compute_gradient

    def slow_compute(*args: Any, **kwargs: Any) -> trainer.GradientResult:
        window.append(time.monotonic())
        time.sleep(1.0)  # holds this thread, like a long forward/backward would
        result = real(*args, **kwargs)
        window.append(time.monotonic())
        return result

    monkeypatch.setattr(trainer, "compute_gradient", slow_compute)
    world.site.heartbeat_s = 0.1
    world.site.replies = [world.lease(1, [(0, 8)])]
    config = AgentConfig(**{**config.__dict__, "max_leases": 1})

    await Agent(config, backoff=FAST_BACKOFF, benchmark_s=0.01).run()

    during = [t for t in world.site.heartbeats if window[0] <= t <= window[1]]
    assert len(during) >= 5
    assert [d.lease_id for d in world.site.of_kind(LeaseDone)] == [1]
