"""A commit written before a rollback and delivered after it is dropped: its step index belongs to the redone
steps now, and applying it would count its leases' samples twice (protocol 2.5, ``timeline``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from crowdtrain_agent.protocol import CheckpointComplete, Rollback, SliceReady, StepApplied, StepCommit

from .conftest import FakeSite, agent_connection, assignment, running_backbone, take_step


async def test_a_commit_of_the_timeline_a_rollback_ended_is_not_applied(site: FakeSite, tmp_path: Path) -> None:
    async with running_backbone(site, tmp_path) as backbone:
        await site.assign(assignment(checkpoint_every=1, staleness=2))
        async with agent_connection(backbone) as agent:
            await take_step(site, agent, 0, lease_id=1)
            await site.send(CheckpointComplete(campaign_id=1, versions=[1]))
            await agent.good_upload(lease_id=2, base_version=1)  # step 1 of timeline 0, about to commit
            await site.call(Rollback(campaign_id=1, version=1, timeline=1), SliceReady)
            await agent.good_upload(lease_id=3, base_version=1)  # the redone step 1
            state = backbone.node.get_slice(1, 0)
            at_one = state.param.detach().clone()

            # The old writer's commit arrives late; then the redone step's commit.
            await site.send(StepCommit(campaign_id=1, step=1, lease_ids=[2], num_samples=4, timeline=0))
            redone = await site.call(StepCommit(campaign_id=1, step=1, lease_ids=[3], num_samples=4, timeline=1),
                                     StepApplied)  # fmt: skip

            assert redone.version == 2
            assert not torch.equal(state.param.detach(), at_one)
            assert 2 in state.pending  # never applied: the site's redo queue has its samples
            await asyncio.sleep(0.05)
            assert site.received.empty()  # the stale commit got no answer at all


async def test_a_commit_of_a_newer_timeline_is_applied_and_becomes_the_one_to_beat(
    site: FakeSite, tmp_path: Path
) -> None:
    # The slice whose failure caused the rollback hears of it from the first redone commit.
    async with running_backbone(site, tmp_path) as backbone:
        await site.assign(assignment(staleness=2))
        async with agent_connection(backbone) as agent:
            await agent.good_upload(lease_id=1, base_version=0)
            await agent.good_upload(lease_id=2, base_version=0)
            applied = await site.call(StepCommit(campaign_id=1, step=0, lease_ids=[1], num_samples=4, timeline=3),
                                      StepApplied)  # fmt: skip
            await site.send(StepCommit(campaign_id=1, step=1, lease_ids=[2], num_samples=4, timeline=2))
            await asyncio.sleep(0.1)

            assert applied.version == 1
            assert backbone.node.timelines[1] == 3
            assert site.received.empty() and backbone.node.get_slice(1, 0).version == 1
