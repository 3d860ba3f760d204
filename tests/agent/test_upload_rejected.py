"""A slice the aggregator rejects means the lease cannot be reported: it is given back instead."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from crowdtrain_agent import trainer
from crowdtrain_agent.config import AgentConfig
from crowdtrain_agent.protocol import LeaseDone, LeaseRelease
from crowdtrain_agent.runtime import Agent

from .conftest import FAST_BACKOFF
from .fakes import World


async def test_a_rejected_upload_releases_the_lease_instead_of_reporting_it(world: World, config: AgentConfig) -> None:
    world.aggregators[1].reject_code = "stale version"
    world.site.replies = [world.lease(1, [(0, 8)])]
    agent = Agent(AgentConfig(**{**config.__dict__, "max_leases": 1}), backoff=FAST_BACKOFF, benchmark_s=0.01)

    code = await agent.run()

    assert code == 0
    assert world.site.of_kind(LeaseDone) == []
    assert world.site.of_kind(LeaseRelease) == [LeaseRelease(lease_id=1)]
    assert agent.status.rejected == 1


async def test_a_gradient_that_is_not_finite_is_given_back_not_uploaded(
    world: World, config: AgentConfig, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The model diverged on these samples: an aggregator would refuse the upload, and a refused upload
    # counts against the volunteer, so an honest agent never sends one.
    honest = trainer.compute_gradient

    def diverged(*args: Any, **kwargs: Any) -> Any:
        result = honest(*args, **kwargs)
        result.grad[3] = float("inf")
        return result

    monkeypatch.setattr(trainer, "compute_gradient", diverged)
    world.site.replies = [world.lease(1, [(0, 8)])]
    agent = Agent(AgentConfig(**{**config.__dict__, "max_leases": 1}), backoff=FAST_BACKOFF, benchmark_s=0.01)

    code = await agent.run()

    assert code == 0
    assert world.site.of_kind(LeaseDone) == []
    assert world.site.of_kind(LeaseRelease) == [LeaseRelease(lease_id=1)]
    assert all(not aggregator.uploads for aggregator in world.aggregators)
    assert "gradient values are NaN or infinite" in caplog.text


def test_the_finiteness_check_names_how_many_values_are_bad() -> None:
    grad = torch.ones(10)
    trainer.finite_or_raise(grad)  # finite: nothing raised
    grad[[2, 5]] = torch.tensor([float("nan"), float("-inf")])

    with pytest.raises(trainer.GradientNotFinite, match="2 of 10 gradient values are NaN or infinite"):
        trainer.finite_or_raise(grad)


def test_a_gradient_past_the_fp16_range_is_refused_for_an_fp16_lease_only() -> None:
    grad = torch.ones(10)
    grad[4] = 70_000.0  # finite in fp32, infinite once sent as fp16

    trainer.finite_or_raise(grad)  # fp32 carries it
    with pytest.raises(trainer.GradientNotFinite, match="past the 6.55e\\+04 the fp16 codec carries"):
        trainer.finite_or_raise(grad, "fp16")
