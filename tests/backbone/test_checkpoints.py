"""Checkpoints: written atomically every N versions, resumed after a restart, and the target of rollbacks."""

from __future__ import annotations

from pathlib import Path

import torch
from crowdtrain_agent.protocol import Rollback, SliceReady
from crowdtrain_backbone.checkpoints import checkpoint_path, list_versions, load_checkpoint
from crowdtrain_backbone.slices import initial_params

from .conftest import FakeSite, agent_connection, assignment, running_backbone, take_step


async def test_it_resumes_from_its_checkpoint_after_a_restart(site: FakeSite, tmp_path: Path) -> None:
    order = assignment(checkpoint_every=2)
    async with running_backbone(site, tmp_path) as first:
        await site.assign(order)
        async with agent_connection(first) as agent:
            for version in range(3):
                await take_step(site, agent, version, lease_id=version + 1)
        at_two = first.node.get_slice(1, 0)
        saved = load_checkpoint(tmp_path, 1, 0, 2)
        optimizer_state = at_two.optimizer.state_dict()

    async with running_backbone(site, tmp_path) as second:
        ready = await site.assign(assignment(checkpoint_every=2, version=2))

        state = second.node.get_slice(1, 0)
        assert ready == SliceReady(campaign_id=1, slice_index=0, version=2)
        assert list_versions(tmp_path, 1, 0) == [2]
        assert torch.equal(state.param.detach(), saved["params"])
        assert saved["config"]["start"] == 0 and saved["version"] == 2
        assert set(state.optimizer.state_dict()["state"][0]) == set(optimizer_state["state"][0])
        async with agent_connection(second) as agent:
            applied = await take_step(site, agent, version=2, lease_id=10)  # resumes training
        assert applied.version == 3


async def test_it_falls_back_to_the_newest_checkpoint_below_the_asked_version(site: FakeSite, tmp_path: Path) -> None:
    async with running_backbone(site, tmp_path) as first:
        await site.assign(assignment(checkpoint_every=2))
        async with agent_connection(first) as agent:
            for version in range(3):
                await take_step(site, agent, version, lease_id=version + 1)

    async with running_backbone(site, tmp_path):
        missing = await site.assign(assignment(checkpoint_every=2, version=3))
    async with running_backbone(site, tmp_path / "empty") as fresh:
        nothing = await site.assign(assignment(version=5))
        fresh_params = fresh.node.get_slice(1, 0).param.detach().clone()

    assert missing.version == 2
    assert nothing.version == 0
    assert torch.equal(fresh_params, initial_params(assignment()))


async def test_it_keeps_the_newest_three_checkpoints(site: FakeSite, tmp_path: Path) -> None:
    async with running_backbone(site, tmp_path) as backbone:
        await site.assign(assignment(checkpoint_every=1, staleness=5))
        async with agent_connection(backbone) as agent:
            for version in range(5):
                await take_step(site, agent, version, lease_id=version + 1)

    assert list_versions(tmp_path, 1, 0) == [3, 4, 5]
    assert checkpoint_path(tmp_path, 1, 0, 5).name == "v00000005.pt"
    assert not [p for p in checkpoint_path(tmp_path, 1, 0, 5).parent.iterdir() if p.name.endswith(".tmp")]


async def test_rollback_restores_the_checkpoint_and_drops_everything_newer(site: FakeSite, tmp_path: Path) -> None:
    async with running_backbone(site, tmp_path) as backbone:
        await site.assign(assignment(checkpoint_every=1, staleness=2))
        async with agent_connection(backbone) as agent:
            await take_step(site, agent, 0, lease_id=1)
            at_one = backbone.node.get_slice(1, 0).param.detach().clone()
            await take_step(site, agent, 1, lease_id=2)
            await take_step(site, agent, 2, lease_id=3)
            await agent.good_upload(lease_id=4, base_version=3)  # newer than the rollback target
            await agent.good_upload(lease_id=5, base_version=1)  # trained on the target: still usable

            ready = await site.call(Rollback(campaign_id=1, version=1), SliceReady)

            state = backbone.node.get_slice(1, 0)
            assert ready.version == 1 and state.version == 1
            assert torch.equal(state.param.detach(), at_one)
            assert set(state.pending) == {5}
            assert list_versions(tmp_path, 1, 0) == [1]
            assert sorted(state.snapshots) == [0, 1]  # older versions are still the same timeline
            applied = await site.commit(1, [5], 4)  # training goes on from the restored version
            assert applied.version == 2
