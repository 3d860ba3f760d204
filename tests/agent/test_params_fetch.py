"""Parameters of a version are assembled from every aggregator's slice."""

from __future__ import annotations

import asyncio

import pytest
import torch
from msgspec.structs import replace

from crowdtrain_agent.fetch import FetchError, HeldParams, fetch_params, fetch_slice

from .fakes import World


async def test_params_are_assembled_from_two_slices(world: World) -> None:
    flat = await asyncio.to_thread(fetch_params, world.routes(), 0, world.params.numel())

    torch.testing.assert_close(flat, world.params)


async def test_a_version_about_to_be_published_is_retried(world: World) -> None:
    world.aggregators[1].missing_first = 2

    flat = await asyncio.to_thread(fetch_params, world.routes(), 0, world.params.numel())

    torch.testing.assert_close(flat, world.params)
    assert len(world.aggregators[1].param_requests) == 3


async def test_slices_with_a_gap_are_refused(world: World) -> None:
    first, second = world.routes()
    gappy = [first, replace(second, start=second.start + 1)]

    with pytest.raises(FetchError, match="do not tile"):
        await asyncio.to_thread(fetch_params, gappy, 0, world.params.numel())


async def test_a_slice_of_the_wrong_size_is_refused_with_both_sizes(world: World) -> None:
    first, _ = world.routes()
    short = replace(first, end=first.end - 1)  # the aggregator sends one element more than this route holds

    with pytest.raises(
        FetchError, match=rf"sends {4 * (first.end - first.start)} bytes, expected {4 * (short.end - short.start)}"
    ):
        await asyncio.to_thread(fetch_slice, short, 0)


async def test_the_leases_ticket_goes_with_every_slice_request(world: World) -> None:
    await asyncio.to_thread(fetch_params, world.routes(), 0, world.params.numel(), ticket="ticket-of-lease-7")

    assert [a.param_auth for a in world.aggregators] == [["Bearer ticket-of-lease-7"]] * 2


async def test_an_aggregator_older_than_deltas_answers_fp32_and_the_agent_takes_it(world: World) -> None:
    held = HeldParams()
    await asyncio.to_thread(fetch_params, world.routes(), 0, world.params.numel(), held=held, campaign_id=7)
    newer = (world.params * 1.01).numpy().astype("<f4")
    world.aggregators[0].params[(0, 1)] = newer[: world.split].tobytes()
    world.aggregators[1].params[(1, 1)] = newer[world.split :].tobytes()

    flat = await asyncio.to_thread(fetch_params, world.routes(), 1, world.params.numel(), held=held, campaign_id=7)

    assert flat.numpy().tobytes() == newer.tobytes()
    assert [a.param_requests[-1] for a in world.aggregators] == ["/params/0/1", "/params/1/1"]
    assert [a.param_queries[-1] for a in world.aggregators] == ["from=0", "from=0"]
