"""An agent holding version v-1 downloads version v from a real aggregator as deltas, verified by checksum."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from crowdtrain_agent.fetch import FetchError, HeldParams, fetch_params
from crowdtrain_agent.netmeter import METER
from crowdtrain_agent.protocol import SliceRoute, StepApplied, StepCommit, UploadReceipt
from crowdtrain_backbone.downloads import DownloadCache

from .conftest import TWO_SLICE_BOUNDS, TWO_SLICE_MODEL, TWO_SLICE_PARAMS, Agent, FakeSite, gradient, ticket

MODEL, PARAMS, BOUNDS = TWO_SLICE_MODEL, TWO_SLICE_PARAMS, TWO_SLICE_BOUNDS


async def _step(site: FakeSite, agent: Agent, version: int, lease_id: int) -> None:
    """Both slices take one step from ``version`` on one lease's gradient."""
    for index, (lo, hi) in enumerate(BOUNDS):
        reply = await agent.upload(ticket(lease_id, base_version=version), gradient(hi - lo, lease_id + index),
                                   slice_index=index)  # fmt: skip
        assert isinstance(reply, UploadReceipt), reply
    await site.send(StepCommit(campaign_id=1, step=version, lease_ids=[lease_id], num_samples=4))
    for _ in BOUNDS:
        await site.expect(StepApplied)


async def _fetch(routes: list[SliceRoute], version: int, held: HeldParams | None = None) -> torch.Tensor:
    return await asyncio.to_thread(
        fetch_params, routes, version, PARAMS, ticket=ticket(50, base_version=version), held=held, campaign_id=1
    )


def _bits(flat: torch.Tensor) -> torch.Tensor:
    return flat.view(torch.int32)


async def test_a_version_rebuilt_from_the_previous_one_equals_the_full_download_bit_for_bit(
    site: FakeSite, two_slices: list[SliceRoute], agent: Agent
) -> None:
    held = HeldParams()
    await _fetch(two_slices, 0, held)
    await _step(site, agent, version=0, lease_id=1)
    received_before = METER.bytes_down

    rebuilt = await _fetch(two_slices, 1, held)
    delta_bytes = METER.bytes_down - received_before
    full = await _fetch(two_slices, 1)

    assert torch.equal(_bits(rebuilt), _bits(full))
    assert not torch.equal(_bits(full), _bits(await _fetch(two_slices, 0)))  # the step changed something
    assert 0 < delta_bytes < 4 * PARAMS  # the network meter saw the smaller body
    base = held.base_for(1, PARAMS, 2)
    assert base is not None and base.version == 1 and torch.equal(_bits(base.flat), _bits(full))


async def test_the_held_copy_is_the_agents_own_not_the_returned_vector(
    site: FakeSite, two_slices: list[SliceRoute], agent: Agent, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="crowdtrain_agent")
    held = HeldParams()
    flat = await _fetch(two_slices, 0, held)
    flat.add_(1.0)  # what a local-steps lease does to a model whose parameters are views of this vector
    await _step(site, agent, version=0, lease_id=1)

    rebuilt = await _fetch(two_slices, 1, held)

    assert torch.equal(_bits(rebuilt), _bits(await _fetch(two_slices, 1)))
    assert "unusable" not in caplog.text  # the deltas applied to the held copy verified: no full download


async def test_a_held_copy_that_fails_the_checksum_is_replaced_by_a_full_download(
    site: FakeSite, two_slices: list[SliceRoute], agent: Agent, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="crowdtrain_agent")
    held = HeldParams()
    await _fetch(two_slices, 0, held)
    base = held.base_for(1, PARAMS, 1)
    assert base is not None
    base.flat[5] += 1.0  # the held version no longer is the one the aggregator published
    await _step(site, agent, version=0, lease_id=1)

    rebuilt = await _fetch(two_slices, 1, held)

    assert torch.equal(_bits(rebuilt), _bits(await _fetch(two_slices, 1)))
    assert "slice 0: the delta from version 0 is unusable (the rebuilt parameters' sha256 is" in caplog.text
    assert "downloading the full version instead" in caplog.text
    assert "slice 1" not in caplog.text  # its held elements were intact: its delta was used


async def test_parameters_that_never_match_their_checksum_are_refused(
    site: FakeSite, two_slices: list[SliceRoute], agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = HeldParams()
    await _fetch(two_slices, 0, held)
    await _step(site, agent, version=0, lease_id=1)

    async def wrong_checksum(self: DownloadCache, snapshot: object) -> str:
        return "0" * 64

    monkeypatch.setattr(DownloadCache, "checksum", wrong_checksum)

    with pytest.raises(FetchError, match="the downloaded parameters' sha256 is .* the aggregator's 000000000000"):
        await _fetch(two_slices, 1, held)
    base = held.base_for(1, PARAMS, 2)
    assert base is not None and base.version == 0  # nothing unverified became the next base
