"""The clip history is part of a slice's checkpoint: a restart or a rollback to version v clips as the run did at v."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from crowdtrain_agent.protocol import CheckpointComplete, Rollback, SliceReady
from crowdtrain_backbone.aggregation import PendingUpload
from crowdtrain_backbone.checkpoints import LocalStore, save_checkpoint
from crowdtrain_backbone.node import restore
from crowdtrain_backbone.slices import MemoryBudget, SliceState, initial_params

from .conftest import SLICE0, FakeSite, agent_connection, assignment, running_backbone, take_step
from .test_checkpoints import wait_for

NUMEL = SLICE0[1] - SLICE0[0]
UNIT = torch.ones(NUMEL) / NUMEL**0.5  # norm 1


def _step(state: SliceState, norms: list[float]) -> None:
    """One step of leases of one sample each, with these gradient norms."""
    lease_ids = [100 * state.version + i for i in range(1, len(norms) + 1)]
    for lease_id, norm in zip(lease_ids, norms, strict=True):
        state.add_pending(PendingUpload(lease_id, state.version, 1, UNIT * norm))
    uploads = state.collect(lease_ids, len(lease_ids))
    state.finish_step(state.apply_step_(uploads, len(lease_ids)), lease_ids)


def test_a_restored_slice_clips_its_next_step_as_the_run_did(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    spec = assignment(clip_factor=4.0, staleness=0)
    running = SliceState(spec, initial_params(spec), 0, MemoryBudget(1 << 30))
    for _ in range(10):
        _step(running, [1.0, 1.2, 0.9])
    save_checkpoint(store, 1, 0, 10, running.checkpoint_dict())
    restored = restore(spec, store, 10, None)
    again = SliceState(spec, restored.params, 10, MemoryBudget(1 << 30), restored.optimizer_state,
                       clip_history=restored.clip_history)  # fmt: skip
    forgetful = SliceState(spec, restored.params, 10, MemoryBudget(1 << 30), restored.optimizer_state)

    # Alone, this step's median is 30 and nothing is cut; after ten steps of norms near 1, all three are.
    for state in (running, again, forgetful):
        _step(state, [30.0, 30.0, 100.0])

    assert again.clip_history.to_list() == running.clip_history.to_list()
    assert torch.equal(again.param.detach(), running.param.detach())
    assert (running.clipped, again.clipped, forgetful.clipped) == (3, 3, 0)
    assert not torch.equal(forgetful.param.detach(), running.param.detach())  # the history is what made it so


async def test_a_rollback_brings_back_the_history_of_its_version(site: FakeSite, tmp_path: Path) -> None:
    async with running_backbone(site, tmp_path) as backbone:
        await site.assign(assignment(checkpoint_every=1, staleness=2))
        async with agent_connection(backbone) as agent:
            await take_step(site, agent, 0, lease_id=1)
            await wait_for(lambda: site.checkpoints)
            await site.send(CheckpointComplete(campaign_id=1, versions=[1]))
            at_one = backbone.node.get_slice(1, 0).clip_history.to_list()
            await take_step(site, agent, 1, lease_id=2)
            await take_step(site, agent, 2, lease_id=3)
            later = backbone.node.get_slice(1, 0).clip_history.to_list()

            ready = await site.call(Rollback(campaign_id=1, version=1), SliceReady)

        state = backbone.node.get_slice(1, 0)
        assert ready.version == 1 and len(at_one) == 1 and len(later) == 3
        assert state.clip_history.to_list() == at_one


def test_a_checkpoint_from_before_clipping_or_with_a_bad_history_starts_it_empty(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = LocalStore(tmp_path)
    spec = assignment()
    state = SliceState(spec, initial_params(spec), 3, MemoryBudget(1 << 30))
    old = state.checkpoint_dict()
    del old["clip_history"]
    bad = state.checkpoint_dict() | {"version": 4, "clip_history": [1.0, float("nan")]}

    save_checkpoint(store, 1, 0, 3, old)
    save_checkpoint(store, 1, 0, 4, bad)

    assert restore(spec, store, 3, None).clip_history.to_list() == []  # type: ignore[union-attr]
    assert restore(spec, store, 4, None).clip_history.to_list() == []  # type: ignore[union-attr]
    assert "checkpoint v4: the clip history holds nan, not a positive finite norm; it starts empty" in caplog.text
