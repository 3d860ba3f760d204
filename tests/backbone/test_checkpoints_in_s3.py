"""Checkpoints in an S3-compatible bucket (a real server: moto's, over HTTP): a new machine restores from it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from crowdtrain_agent.protocol import SliceReady
from crowdtrain_backbone.checkpoints import S3Store, StorageUnusable, load_checkpoint, save_checkpoint, to_prune
from tests.s3server import s3_server

from .conftest import FakeSite, agent_connection, assignment, running_backbone, take_step


@pytest.fixture(scope="module")
def s3_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    with s3_server(tmp_path_factory.mktemp("s3")) as env:
        yield env


def store_of(env: dict[str, str], prefix: str = "checkpoints") -> S3Store:
    return S3Store.from_url(f"s3://{env['CROWDTRAIN_S3_BUCKET']}/{prefix}", env)


def test_it_writes_lists_reads_and_deletes_checkpoints(s3_env: dict[str, str]) -> None:
    store = store_of(s3_env, "unit")
    store.check_writable()
    state = {"config": {}, "version": 7, "params": torch.arange(4.0), "optimizer": {}}

    where = save_checkpoint(store, 3, 1, 7, state)
    save_checkpoint(store, 3, 1, 12, {**state, "version": 12})

    assert where == f"s3://{s3_env['CROWDTRAIN_S3_BUCKET']}/unit/campaign-3/slice-1/v00000007.pt"
    assert store.versions(3, 1) == [7, 12] and store.versions(3, 0) == []
    assert torch.equal(load_checkpoint(store, 3, 1, 7)["params"], torch.arange(4.0))
    store.delete(3, 1, 7)
    assert store.versions(3, 1) == [12]
    assert to_prune(store.versions(3, 1), current=12, complete=[]) == []


def test_a_bucket_it_cannot_write_is_refused_with_what_to_check(s3_env: dict[str, str]) -> None:
    missing = S3Store.from_url("s3://no-such-bucket-here/x", s3_env)
    with pytest.raises(StorageUnusable, match="cannot write checkpoints to s3://no-such-bucket-here/x"):
        missing.check_writable()


async def test_a_replacement_on_an_empty_disk_restores_its_slice_from_the_bucket(
    site: FakeSite, s3_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in s3_env.items():  # what an operator sets: the site's bucket variables
        monkeypatch.setenv(name, value)
    url = f"s3://{s3_env['CROWDTRAIN_S3_BUCKET']}/replace"
    async with running_backbone(site, tmp_path / "machine-a", checkpoint_url=url) as first:
        await site.assign(assignment(checkpoint_every=2))
        async with agent_connection(first) as agent:
            for version in range(2):
                await take_step(site, agent, version, lease_id=version + 1)
        expected = first.node.get_slice(1, 0).param.detach().clone()

    # Another machine: an empty disk, the same bucket.
    async with running_backbone(site, tmp_path / "machine-b", checkpoint_url=url) as second:
        ready = await site.assign(assignment(checkpoint_every=2, version=2))
        assert ready == SliceReady(campaign_id=1, slice_index=0, version=2)
        assert torch.equal(second.node.get_slice(1, 0).param.detach(), expected)
    assert not list(tmp_path.rglob("*.pt")), "nothing should have gone to the local folders"
