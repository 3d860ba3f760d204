"""Checkpoints: written atomically every N versions, confirmed to the site, resumed only at versions it vouches for."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from crowdtrain_agent.protocol import (
    CheckpointComplete,
    CheckpointSaved,
    Rollback,
    SliceLost,
    SliceReady,
    StepApplied,
    StepCommit,
)
from crowdtrain_backbone.checkpoints import (
    CheckpointError,
    LocalStore,
    StorageUnusable,
    load_checkpoint,
    save_checkpoint,
    to_prune,
)
from crowdtrain_backbone.node import restore
from crowdtrain_backbone.slices import MemoryBudget, SliceState, initial_params

from .conftest import FakeSite, agent_connection, assignment, running_backbone, take_step


async def wait_for(predicate, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def test_it_resumes_from_its_checkpoint_after_a_restart(site: FakeSite, tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    async with running_backbone(site, tmp_path) as first:
        await site.assign(assignment(checkpoint_every=2))
        async with agent_connection(first) as agent:
            for version in range(3):
                await take_step(site, agent, version, lease_id=version + 1)
        at_two = first.node.get_slice(1, 0)
        await wait_for(lambda: site.checkpoints)
        saved = load_checkpoint(store, 1, 0, 2)
        optimizer_state = at_two.optimizer.state_dict()

    assert site.checkpoints[0] == CheckpointSaved(campaign_id=1, slice_index=0, version=2)
    async with running_backbone(site, tmp_path) as second:
        ready = await site.assign(assignment(checkpoint_every=2, version=2))

        state = second.node.get_slice(1, 0)
        assert ready == SliceReady(campaign_id=1, slice_index=0, version=2)
        assert store.versions(1, 0) == [2]
        assert torch.equal(state.param.detach(), saved["params"])
        assert saved["config"]["start"] == 0 and saved["version"] == 2
        assert set(state.optimizer.state_dict()["state"][0]) == set(optimizer_state["state"][0])
        async with agent_connection(second) as agent:
            applied = await take_step(site, agent, version=2, lease_id=10)  # resumes training
        assert applied.version == 3


async def test_without_the_asked_version_it_goes_to_the_complete_one_the_site_names(
    site: FakeSite, tmp_path: Path
) -> None:
    async with running_backbone(site, tmp_path) as first:
        await site.assign(assignment(checkpoint_every=1, staleness=5))
        await site.send(CheckpointComplete(campaign_id=1, versions=[1]))
        async with agent_connection(first) as agent:
            for version in range(3):
                await take_step(site, agent, version, lease_id=version + 1)
        await wait_for(lambda: len(site.checkpoints) == 3)
    # v3 is its own newest, but the site vouches only for v1 (another slice may lack v2 and v3).
    async with running_backbone(site, tmp_path) as second:
        ready = await site.assign(assignment(checkpoint_every=1, version=4, restore_version=1))
        assert ready.version == 1
        assert second.node.get_slice(1, 0).version == 1
    # Checkpoints above the version it resumed from belonged to a timeline that is gone.
    assert LocalStore(tmp_path).versions(1, 0) == [1]


async def test_a_stepped_campaign_is_never_silently_reset_to_the_initial_weights(
    site: FakeSite, tmp_path: Path
) -> None:
    async with running_backbone(site, tmp_path / "empty") as fresh:
        lost = await site.call(assignment(version=5), SliceLost)
        assert fresh.node.get_slice(1, 0) is None
    assert lost.version == 5 and "no complete checkpoint" in lost.detail

    async with running_backbone(site, tmp_path / "empty") as fresh:
        lost = await site.call(assignment(version=5, restore_version=3), SliceLost)
    assert "v00000003.pt" in lost.detail

    async with running_backbone(site, tmp_path / "empty") as fresh:
        ready = await site.assign(assignment(version=5, restore_version=0))  # an operator chose to start over
        assert ready.version == 0
        assert torch.equal(fresh.node.get_slice(1, 0).param.detach(), initial_params(assignment()))


def test_pruning_keeps_recent_and_complete_versions_of_the_current_timeline() -> None:
    # The newest two at or below the current version, and the newest two complete ones.
    assert to_prune([5, 10, 15, 20, 25], current=25, complete=[5, 10]) == [15]
    # Versions above the current one belong to a timeline a rollback ended: they go, however new.
    assert to_prune([5, 10, 140, 145, 170], current=10, complete=[5]) == [140, 145, 170]
    assert to_prune([], current=3, complete=[]) == []


async def test_it_prunes_by_recency_but_keeps_what_the_site_can_restore(site: FakeSite, tmp_path: Path) -> None:
    async with running_backbone(site, tmp_path) as backbone:
        await site.assign(assignment(checkpoint_every=1, staleness=5))
        await site.send(CheckpointComplete(campaign_id=1, versions=[1]))
        async with agent_connection(backbone) as agent:
            for version in range(5):
                await take_step(site, agent, version, lease_id=version + 1)
        await wait_for(lambda: len(site.checkpoints) == 5)

    assert LocalStore(tmp_path).versions(1, 0) == [1, 4, 5]
    assert not list(tmp_path.rglob("*.tmp"))


async def test_rollback_restores_the_checkpoint_and_drops_everything_newer(site: FakeSite, tmp_path: Path) -> None:
    async with running_backbone(site, tmp_path) as backbone:
        await site.assign(assignment(checkpoint_every=1, staleness=2))
        async with agent_connection(backbone) as agent:
            await take_step(site, agent, 0, lease_id=1)
            await wait_for(lambda: site.checkpoints)
            await site.send(CheckpointComplete(campaign_id=1, versions=[1]))  # the site rolls back only to those
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
            assert LocalStore(tmp_path).versions(1, 0) == [1]
            assert sorted(state.snapshots) == [0, 1]  # older versions are still the same timeline
            applied = await site.commit(1, [5], 4)  # training goes on from the restored version
            assert applied.version == 2


async def test_a_graceful_stop_keeps_the_uploads_of_the_step_in_hand(site: FakeSite, tmp_path: Path) -> None:
    async with running_backbone(site, tmp_path) as first:
        await site.assign(assignment(staleness=2))
        async with agent_connection(first) as agent:
            await take_step(site, agent, 0, lease_id=1)
            await agent.good_upload(2, base_version=1)
            await agent.good_upload(3, base_version=0)  # one version stale, inside the window
        assert await first.shutdown() == 1
        # What the stopped process would have made of step 1: the restarted one must make the same.
        state = first.node.get_slice(1, 0)
        await first.node.commit(StepCommit(campaign_id=1, step=1, lease_ids=[2, 3], num_samples=8))
        reference = state.param.detach().clone()

    saved = load_checkpoint(LocalStore(tmp_path), 1, 0, 1)
    assert [(p["lease_id"], p["base_version"], p["num_samples"]) for p in saved["pending"]] == [(2, 1, 4), (3, 0, 4)]
    async with running_backbone(site, tmp_path) as second:
        ready = await site.assign(assignment(staleness=2, version=1))
        assert ready.version == 1
        assert sorted(second.node.get_slice(1, 0).pending) == [2, 3]
        applied = await site.commit(1, [2, 3], 8)
        assert isinstance(applied, StepApplied) and applied.version == 2
        assert torch.equal(second.node.get_slice(1, 0).param.detach(), reference)


def test_saved_uploads_come_back_only_with_their_own_version_and_only_when_sound(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = LocalStore(tmp_path)
    spec = assignment(staleness=1)
    numel = spec.end - spec.start
    state = SliceState(spec, initial_params(spec), 3, MemoryBudget(3 * numel * 4))

    def upload(lease_id: int, base: int, grad: object = None, n: object = 4) -> dict[str, object]:
        grad = torch.ones(numel) if grad is None else grad
        return {"lease_id": lease_id, "base_version": base, "num_samples": n, "grad": grad}

    saved = [
        upload(1, 3), upload(2, 2),
        upload(3, 1),  # below the window [2, 3]
        upload(4, 3, grad=torch.ones(numel + 1)), upload(5, 3, grad=torch.ones(numel, dtype=torch.float64)),
        upload(6, 3, n=0), upload(7, 3, n="4"), "not an upload",
        upload(1, 3),  # a replay of one already held
        upload(8, 3), upload(9, 3),  # the budget holds three
    ]  # fmt: skip
    assert state.reinstate_(saved) == [1, 2, 8]
    assert sorted(state.pending) == [1, 2, 8] and state.budget.used == 3 * numel * 4
    for why in ("lease 3 trained on version 1", f"lease 4: the gradient is not {numel} fp32 values",
                f"lease 5: the gradient is not {numel}", "the count above 0; found 6, 3, 0",
                "the count above 0; found 7, 3, '4'", "expected a dict, found str", "lease 1 already uploaded",
                "no memory left to take back saved upload of lease 9"):  # fmt: skip
        assert why in caplog.text

    save_checkpoint(store, 1, 0, 3, state.checkpoint_dict(with_pending=True))
    assert len(restore(spec, store, 3, None).pending) == 3
    # Back to a complete version instead: the site rolled back and rejected those leases.
    assert restore(spec, store, 5, 3).pending == []
    assert "pending" not in state.checkpoint_dict()  # a scheduled checkpoint carries none


class DiskFull(LocalStore):
    """A store whose writes fail the way torch reports a full disk, after leaving a partial temporary file."""

    failing = True

    def write(self, campaign_id: int, slice_index: int, version: int, data: bytes) -> str:
        if not self.failing:
            return super().write(campaign_id, slice_index, version, data)
        tmp = self.path(campaign_id, slice_index, version).with_name(".partial.tmp")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        try:
            tmp.write_bytes(data[:10])
            raise RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos 4096 vs 2048")
        finally:
            tmp.unlink(missing_ok=True)


async def test_a_failed_save_is_reported_truthfully_and_the_step_still_counts(
    site: FakeSite, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = DiskFull(tmp_path)
    async with running_backbone(site, tmp_path) as backbone:
        backbone.node.store = store
        await site.assign(assignment(checkpoint_every=1, staleness=3))
        async with agent_connection(backbone) as agent:
            applied = await take_step(site, agent, 0, lease_id=1)  # the applied reply still comes
            assert applied.version == 1
            store.failing = False  # the disk has room again
            await take_step(site, agent, 1, lease_id=2)
            await wait_for(lambda: site.checkpoints)

    assert "checkpoint of version 1 failed: RuntimeError" in caplog.text
    assert "the step itself was applied" in caplog.text
    assert [c.version for c in site.checkpoints] == [2]
    assert store.versions(1, 0) == [2]
    assert not list(tmp_path.rglob("*.tmp"))


def test_save_wraps_every_failure_in_a_checkpoint_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="checkpoint of version 3 failed"):
        save_checkpoint(DiskFull(tmp_path), 1, 0, 3, {"version": 3})


def test_an_unwritable_location_is_refused_with_what_to_fix(tmp_path: Path) -> None:
    a_file = tmp_path / "not-a-folder"
    a_file.write_text("x")
    with pytest.raises(StorageUnusable, match="not a writable folder.*--checkpoint-dir"):
        LocalStore(a_file).check_writable()
    LocalStore(tmp_path / "new" / "folder").check_writable()  # created when missing
