"""An exception in a slice's optimizer step is answered with a StepFailed that says what broke, never silence."""

from __future__ import annotations

import pytest
import torch

from crowdtrain_agent.protocol import OptimizerSpec, SliceAssignment, SliceLost, SliceReady, StepApplied, StepFailed
from crowdtrain_backbone.node import AggregatorNode
from crowdtrain_backbone.server import BackboneServer
from crowdtrain_backbone.slices import initial_params

from .conftest import SLICE0, Agent, FakeSite, assignment, gradient

NUMEL = SLICE0[1] - SLICE0[0]
SGD = OptimizerSpec(name="sgd", lr=0.5)


def break_the_optimizer(backbone: BackboneServer, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make slice 0's next optimizer steps change the params half-way and raise; returns the call count."""
    state = backbone.node.get_slice(1, 0)
    calls: list[int] = []

    def failing_step(*args: object, **kwargs: object) -> None:
        calls.append(1)
        with torch.no_grad():
            state.param.add_(1.0)  # half a step: what a failure deep in the optimizer may leave behind
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(state.optimizer, "step", failing_step)
    return calls


async def test_the_site_hears_which_step_failed_and_why(
    site: FakeSite, backbone: BackboneServer, agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    await site.assign(assignment(optimizer=SGD))
    break_the_optimizer(backbone, monkeypatch)
    await agent.good_upload(lease_id=1)

    reply = await site.commit(0, [1], 4)

    assert isinstance(reply, StepFailed)
    assert (reply.step, reply.slice_index, reply.missing_lease_ids) == (0, 0, [])
    assert "could not apply step 0: RuntimeError: CUDA error: an illegal memory access" in reply.detail
    assert backbone.node.get_slice(1, 0).version == 0


async def test_the_same_commit_again_gets_the_same_answer_without_a_second_try(
    site: FakeSite, backbone: BackboneServer, agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    await site.assign(assignment(optimizer=SGD))
    calls = break_the_optimizer(backbone, monkeypatch)
    await agent.good_upload(lease_id=1)
    first = await site.commit(0, [1], 4)

    again = await site.commit(0, [1], 4)

    assert again == first
    assert calls == [1]  # a second try could apply part of the step twice


async def test_an_assignment_reloads_the_broken_slice_and_the_step_then_applies_once(
    site: FakeSite, backbone: BackboneServer, agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    await site.assign(assignment(optimizer=SGD))
    break_the_optimizer(backbone, monkeypatch)
    await agent.good_upload(lease_id=1)
    await site.commit(0, [1], 4)

    ready = await site.assign(assignment(optimizer=SGD))  # what the site sends when the aggregator reconnects
    applied = await site.commit(0, [1], 4)

    assert ready == SliceReady(campaign_id=1, slice_index=0, version=0)
    assert applied == StepApplied(campaign_id=1, slice_index=0, step=0, version=1)
    expected = initial_params(assignment()) - 0.5 * gradient(NUMEL, 1) / 4
    torch.testing.assert_close(backbone.node.get_slice(1, 0).param.detach(), expected)
    assert backbone.node.broken == {}


async def test_an_exception_outside_the_step_is_answered_too(
    site: FakeSite, backbone: BackboneServer, agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    await site.assign(assignment(optimizer=SGD))
    await agent.good_upload(lease_id=1)

    async def crash(self: AggregatorNode, commit: object) -> list[object]:
        raise RuntimeError("boom in the node")

    monkeypatch.setattr(AggregatorNode, "commit", crash)
    reply = await site.commit(0, [1], 4)

    assert isinstance(reply, StepFailed) and reply.step == 0 and reply.missing_lease_ids == []
    assert "RuntimeError: boom in the node" in reply.detail


async def test_an_assignment_that_raises_loses_the_slice_saying_why(
    site: FakeSite, backbone: BackboneServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def crash(self: AggregatorNode, order: SliceAssignment) -> SliceReady:
        raise MemoryError("cannot allocate the slice")

    monkeypatch.setattr(AggregatorNode, "assign", crash)
    await site.send(assignment())

    lost = await site.expect(SliceLost)

    assert (lost.campaign_id, lost.slice_index) == (1, 0)
    assert "MemoryError: cannot allocate the slice" in lost.detail
