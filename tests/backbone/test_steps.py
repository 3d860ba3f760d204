"""Step commits from the site: applied in order, idempotent, refused when leases are missing."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from crowdtrain_agent.protocol import OptimizerSpec, SliceReady, SliceUnassign, StepApplied, StepCommit, StepFailed
from crowdtrain_backbone import node
from crowdtrain_backbone.server import BackboneServer
from crowdtrain_backbone.slices import PendingUpload, SliceState, Snapshot, initial_params

from .conftest import SLICE0, Agent, FakeSite, assignment, gradient, take_step, ticket

NUMEL = SLICE0[1] - SLICE0[0]


async def test_it_applies_a_committed_step_and_publishes_the_next_version(
    site: FakeSite, backbone: BackboneServer, agent: Agent
) -> None:
    await site.assign(assignment(optimizer=OptimizerSpec(name="sgd", lr=0.5)))
    await agent.good_upload(lease_id=2, num_samples=3)
    await agent.good_upload(lease_id=1, num_samples=1)

    reply = await site.commit(0, [2, 1], 4)

    assert reply == StepApplied(campaign_id=1, slice_index=0, step=0, version=1)
    expected = initial_params(assignment()) - 0.5 * (gradient(NUMEL, 1) + gradient(NUMEL, 2)) / 4
    state = backbone.node.get_slice(1, 0)
    torch.testing.assert_close(state.param.detach(), expected)
    assert state.pending == {} and state.finished == {2: "committed", 1: "committed"}
    assert backbone.node.budget.used == 0


async def test_it_fails_a_step_with_missing_leases_and_changes_nothing(
    site: FakeSite, held: SliceReady, backbone: BackboneServer, agent: Agent
) -> None:
    await agent.good_upload(lease_id=1)
    before = backbone.node.get_slice(1, 0).param.detach().clone()

    reply = await site.commit(0, [1, 2, 3], 12)

    assert isinstance(reply, StepFailed) and reply.missing_lease_ids == [2, 3] and reply.step == 0
    state = backbone.node.get_slice(1, 0)
    assert state.version == 0 and set(state.pending) == {1}
    assert torch.equal(state.param.detach(), before)


async def test_it_fails_a_step_whose_sample_count_disagrees(
    site: FakeSite, held: SliceReady, backbone: BackboneServer, agent: Agent
) -> None:
    await agent.good_upload(lease_id=1, num_samples=4)

    reply = await site.commit(0, [1], 5)

    assert isinstance(reply, StepFailed) and "5 samples" in reply.detail
    assert backbone.node.get_slice(1, 0).version == 0


async def test_a_repeated_commit_gets_the_same_answer_without_stepping_again(
    site: FakeSite, held: SliceReady, backbone: BackboneServer, agent: Agent
) -> None:
    await take_step(site, agent, version=0, lease_id=1)
    after_first = backbone.node.get_slice(1, 0).param.detach().clone()

    reply = await site.commit(0, [1], 4)

    assert reply == StepApplied(campaign_id=1, slice_index=0, step=0, version=1)
    assert torch.equal(backbone.node.get_slice(1, 0).param.detach(), after_first)


async def test_it_fails_a_commit_ahead_of_its_version(site: FakeSite, held: SliceReady, agent: Agent) -> None:
    await agent.good_upload(lease_id=1)

    reply = await site.commit(3, [1], 4)

    assert isinstance(reply, StepFailed) and "version 0" in reply.detail


async def test_it_drops_pending_uploads_that_fell_out_of_the_window(
    site: FakeSite, held: SliceReady, backbone: BackboneServer, agent: Agent
) -> None:
    await agent.good_upload(lease_id=1)  # trained on version 0, never committed
    await take_step(site, agent, version=0, lease_id=2)  # version 1: lease 1 is still usable (staleness 1)
    assert 1 in backbone.node.get_slice(1, 0).pending

    await take_step(site, agent, version=1, lease_id=3)  # version 2: lease 1 can never be committed

    state = backbone.node.get_slice(1, 0)
    assert 1 not in state.pending and state.finished[1] == "dropped"
    assert backbone.node.budget.used == 0


async def test_it_steps_every_slice_of_the_campaign_it_holds(
    site: FakeSite, backbone: BackboneServer, agent: Agent
) -> None:
    await site.assign(assignment())
    await site.assign(assignment(slice_index=1, bounds=(40, 67)))
    await agent.good_upload(lease_id=1)
    await agent.upload(ticket(1), gradient(27, 9),
                       slice_index=1)  # fmt: skip

    await site.send(StepCommit(
        campaign_id=1, step=0, lease_ids=[1], num_samples=4))  # fmt: skip

    replies = [await site.expect(StepApplied), await site.expect(StepApplied)]
    assert sorted(r.slice_index for r in replies) == [0, 1]


async def test_unassign_drops_the_campaign_and_its_pending_memory(
    site: FakeSite, held: SliceReady, backbone: BackboneServer, agent: Agent
) -> None:
    await agent.good_upload(lease_id=1)

    await site.send(SliceUnassign(campaign_id=1))
    reassigned = await site.assign(assignment(campaign_id=3))

    assert reassigned.campaign_id == 3
    assert backbone.node.get_slice(1, 0) is None and backbone.node.budget.used == 0


async def test_a_reassignment_with_a_new_learning_rate_keeps_the_params_and_uses_the_new_rate(
    site: FakeSite, backbone: BackboneServer, agent: Agent
) -> None:
    await site.assign(assignment(optimizer=OptimizerSpec(name="sgd", lr=0.5)))
    before = backbone.node.get_slice(1, 0).param.detach().clone()

    ready = await site.assign(assignment(optimizer=OptimizerSpec(name="sgd", lr=0.25)))
    await agent.good_upload(lease_id=1, num_samples=1)
    await site.commit(0, [1], 1)

    assert ready.version == 0
    torch.testing.assert_close(backbone.node.get_slice(1, 0).param.detach(), before - 0.25 * gradient(NUMEL, 1))


async def test_uploads_keep_flowing_while_a_step_runs(
    site: FakeSite, held: SliceReady, backbone: BackboneServer, agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow_step = SliceState.apply_step_

    def apply_slowly(self: SliceState, uploads: list[PendingUpload], num_samples: int) -> Snapshot:
        time.sleep(0.5)  # a big model's optimizer step, in the worker thread
        return slow_step(self, uploads, num_samples)

    monkeypatch.setattr(SliceState, "apply_step_", apply_slowly)
    monkeypatch.setattr(node, "INLINE_STEP_ELEMENTS", 0)  # a big model's step: in the worker thread
    await agent.good_upload(lease_id=1)
    await site.send(StepCommit(campaign_id=1, step=0, lease_ids=[1], num_samples=4))
    await asyncio.sleep(0.05)

    started = time.monotonic()
    await agent.good_upload(lease_id=2)
    uploaded_after = time.monotonic() - started
    applied = await site.expect(StepApplied)

    assert uploaded_after < 0.3
    assert applied.version == 1 and set(backbone.node.get_slice(1, 0).pending) == {2}


async def test_a_small_step_is_applied_on_the_loop_not_in_a_thread_that_must_win_the_gil_back(
    site: FakeSite, held: SliceReady, agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    threaded: list[object] = []

    async def to_thread(func: object, /, *args: object) -> object:
        threaded.append(func)
        raise AssertionError("a step of a few elements went to a worker thread")

    monkeypatch.setattr(node.asyncio, "to_thread", to_thread)
    await agent.good_upload(lease_id=1)
    await site.send(StepCommit(campaign_id=1, step=0, lease_ids=[1], num_samples=4))

    applied = await site.expect(StepApplied)
    assert applied.version == 1 and threaded == []
    assert NUMEL <= node.INLINE_STEP_ELEMENTS  # what made it small


async def test_a_reassignment_behind_the_slice_keeps_the_steps_it_applied(
    site: FakeSite, held: SliceReady, backbone: BackboneServer, agent: Agent
) -> None:
    await agent.good_upload(lease_id=1, num_samples=4)
    await site.commit(0, [1], 4)
    applied = backbone.node.get_slice(1, 0).param.detach().clone()

    # The site's version is its slowest slice's, so after a reconnect it may re-assign at 0.
    ready = await site.assign(assignment(version=0))

    assert ready.version == 1
    assert torch.equal(backbone.node.get_slice(1, 0).param.detach(), applied)
