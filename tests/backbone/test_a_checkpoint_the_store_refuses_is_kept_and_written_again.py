"""A checkpoint the store refuses (storage down, disk full) is kept in a local folder, from which a restart on
the same machine resumes, and written to the store again until it takes it; only then is it confirmed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from crowdtrain_backbone.checkpoints import LocalStore

from .conftest import FakeSite, agent_connection, assignment, running_backbone, take_step


async def wait_for_checkpoints(site: FakeSite, count: int, timeout_s: float = 15.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while len(site.checkpoints) < count:
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{len(site.checkpoints)} checkpoints confirmed, not {count}")
        await asyncio.sleep(0.05)


async def test_refused_checkpoints_wait_in_the_fallback_and_a_restart_resumes_from_them(
    site: FakeSite, tmp_path: Path
) -> None:
    store_dir, fallback = tmp_path / "store", tmp_path / "fallback"
    store_dir.write_text("a file where the folder should be: every write fails, as with storage down")
    async with running_backbone(site, store_dir, checkpoint_fallback_dir=fallback) as first:
        await site.assign(assignment(checkpoint_every=1, staleness=2))
        async with agent_connection(first) as agent:
            for version in range(3):
                await take_step(site, agent, version, lease_id=version + 1)
        at_three = first.node.get_slice(1, 0).param.detach().clone()
        failures = first.node.metrics.checkpoint_failures.labels("1", "0")._value.get()

        assert site.checkpoints == []  # nothing the site could restore from on another machine
        assert LocalStore(fallback).versions(1, 0)[-1] == 3
        assert failures >= 3 and (1, 0) in first.node.owed

    async with running_backbone(site, store_dir, checkpoint_fallback_dir=fallback) as second:
        ready = await site.assign(assignment(checkpoint_every=1, staleness=2, version=3))
        resumed = second.node.get_slice(1, 0).param.detach().clone()
        store_dir.unlink()  # storage is back
        await wait_for_checkpoints(site, 1)

    assert ready.version == 3 and torch.equal(resumed, at_three)
    assert [c.version for c in site.checkpoints] == [3]
    assert LocalStore(store_dir).versions(1, 0) == [3]
    assert 3 not in LocalStore(fallback).versions(1, 0)  # the store holds it now


async def test_without_a_fallback_a_refused_checkpoint_is_still_written_again_once_the_store_is_back(
    site: FakeSite, tmp_path: Path
) -> None:
    store_dir = tmp_path / "store"
    store_dir.write_text("not a folder")
    async with running_backbone(site, store_dir) as backbone:
        await site.assign(assignment(checkpoint_every=1, staleness=2))
        async with agent_connection(backbone) as agent:
            await take_step(site, agent, 0, lease_id=1)
            store_dir.unlink()
            await wait_for_checkpoints(site, 1)

    assert [c.version for c in site.checkpoints] == [1]
    assert backbone.node.owed == {}
