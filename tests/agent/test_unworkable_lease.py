"""A lease the agent cannot work on (unknown model, missing shard) is given back, and work goes on."""

from __future__ import annotations

from dataclasses import replace

import msgspec
import pytest

from crowdtrain_agent import runtime
from crowdtrain_agent.config import AgentConfig
from crowdtrain_agent.protocol import LeaseDone, LeaseRelease, ModelSpec, SampleRange
from crowdtrain_agent.runtime import Agent

from .conftest import FAST_BACKOFF
from .fakes import World


async def test_unknown_model_and_missing_shard_leases_are_released(
    world: World, config: AgentConfig, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runtime, "LEASE_ERROR_PAUSE_S", 0.01)
    unknown_model = msgspec.structs.replace(
        world.lease(1, [(0, 4)]), model=ModelSpec(architecture="resnet9000", config={})
    )
    missing_shard = msgspec.structs.replace(
        world.lease(2, [(0, 4)]), ranges=[SampleRange(shard="0" * 64, start=0, count=4)]
    )
    world.site.replies = [unknown_model, missing_shard, world.lease(3, [(0, 4)])]

    code = await Agent(replace(config, max_leases=3), backoff=FAST_BACKOFF, benchmark_s=0.01).run()

    assert code == 0
    assert world.site.of_kind(LeaseRelease) == [LeaseRelease(lease_id=1), LeaseRelease(lease_id=2)]
    assert [d.lease_id for d in world.site.of_kind(LeaseDone)] == [3]
    assert "unknown architecture 'resnet9000'" in caplog.text
    assert "HTTP 404" in caplog.text
