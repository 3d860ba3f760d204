"""The whole agent against a fake site and two fake aggregators: two leases, end to end."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

from crowdtrain_agent.config import AgentConfig
from crowdtrain_agent.credit import credit_for
from crowdtrain_agent.models import get_model
from crowdtrain_agent.protocol import LeaseDone, LeaseRequest, Receipt, sign_receipt
from crowdtrain_agent.runtime import Agent

from .conftest import FAST_BACKOFF
from .fakes import TICKET_KEY, World

LEASE_1 = [(0, 10), (20, 6)]
LEASE_2 = [(10, 7)]


async def test_it_uploads_each_leases_gradient_and_reports_the_receipts(world: World, config: AgentConfig) -> None:
    world.site.replies = [world.lease(1, LEASE_1, microbatch=4), world.lease(2, LEASE_2, microbatch=3)]
    agent = Agent(config, backoff=FAST_BACKOFF, benchmark_s=0.01)

    code = await agent.run()

    assert code == 0
    for lease_id, ranges in ((1, LEASE_1), (2, LEASE_2)):
        uploaded = torch.cat([world.aggregators[0].uploads[(lease_id, 0)], world.aggregators[1].uploads[(lease_id, 1)]])
        torch.testing.assert_close(uploaded, world.expected_gradient(ranges))
    done = world.site.of_kind(LeaseDone)
    assert [d.lease_id for d in done] == [1, 2]
    assert done[0].num_samples == 16 and done[1].num_samples == 7
    assert done[0].receipts == [
        Receipt(slice_index=i, token=sign_receipt(TICKET_KEY, campaign_id=7, lease_id=1, slice_index=i, num_samples=16))
        for i in (0, 1)
    ]


async def test_a_second_lease_at_the_same_version_downloads_nothing(world: World, config: AgentConfig) -> None:
    world.site.replies = [world.lease(1, LEASE_1), world.lease(2, LEASE_2)]

    await Agent(config, backoff=FAST_BACKOFF, benchmark_s=0.01).run()

    # The second lease only asks whether version 0 is still the one it holds (a 304 without a body).
    assert [agg.param_downloads for agg in world.aggregators] == [1, 1]
    assert [len(agg.param_requests) for agg in world.aggregators] == [2, 2]
    assert world.site.shard_requests == [world.sha]
    assert [agg.connections for agg in world.aggregators] == [1, 1]  # one data connection per aggregator, reused


async def test_it_asks_for_the_next_lease_while_the_current_one_computes(world: World, config: AgentConfig) -> None:
    world.site.replies = [world.lease(1, LEASE_1), world.lease(2, LEASE_2), world.lease(3, LEASE_1)]
    config = replace(config, max_leases=3)

    await Agent(config, backoff=FAST_BACKOFF, benchmark_s=0.01).run()

    kinds = [type(m).__name__ for m in world.site.received]
    assert kinds.index("LeaseRequest", 1) < kinds.index("LeaseDone")
    requests = world.site.of_kind(LeaseRequest)
    # The second request goes out as the first lease starts computing; the third knows the measured speed.
    assert requests[0].samples_per_s is None and requests[2].samples_per_s is not None


async def test_fp16_leases_upload_half_precision_gradients(world: World, config: AgentConfig) -> None:
    world.site.replies = [world.lease(1, LEASE_1, codec="fp16"), world.lease(2, LEASE_2, codec="fp16")]

    await Agent(config, backoff=FAST_BACKOFF, benchmark_s=0.01).run()

    uploaded = torch.cat([world.aggregators[0].uploads[(1, 0)], world.aggregators[1].uploads[(1, 1)]])
    expected = world.expected_gradient(LEASE_1)
    torch.testing.assert_close(uploaded, expected.half().float())


async def test_int8_leases_feed_each_uploads_rounding_error_into_the_next(world: World, config: AgentConfig) -> None:
    world.site.replies = [world.lease(1, LEASE_1, codec="int8", codec_block_size=32),
                          world.lease(2, LEASE_2, codec="int8", codec_block_size=32)]  # fmt: skip

    await Agent(config, backoff=FAST_BACKOFF, benchmark_s=0.01).run()

    def uploaded(lease_id: int) -> torch.Tensor:
        return torch.cat([world.aggregators[0].uploads[(lease_id, 0)], world.aggregators[1].uploads[(lease_id, 1)]])

    first, second = uploaded(1), uploaded(2)
    true_1, true_2 = world.expected_gradient(LEASE_1), world.expected_gradient(LEASE_2)
    # The two uploads telescope: together they miss the true sum by the second's residual alone.
    carried = true_2 + (true_1 - first)
    assert (first + second - true_1 - true_2).abs().max() <= carried.abs().max() / 254 * 1.01
    assert (second - true_2).abs().max() > carried.abs().max() / 254  # the first's residual went into it


async def test_each_accepted_done_gets_a_receipt_with_its_flops_and_credit(
    world: World, config: AgentConfig, caplog: pytest.LogCaptureFixture
) -> None:
    world.site.replies = [world.lease(1, LEASE_1, microbatch=4), world.lease(2, LEASE_2, microbatch=3)]
    agent = Agent(config, backoff=FAST_BACKOFF, benchmark_s=0.01)

    with caplog.at_level(logging.INFO, logger="crowdtrain_agent"):
        assert await agent.run() == 0

    lease = world.lease(1, LEASE_1)
    per_sample = get_model(lease.model.architecture).flops_per_sample(lease.model.config)
    receipts = [r.getMessage() for r in caplog.records if "credit granted when step" in r.getMessage()]
    assert len(receipts) == 2
    assert f"{16 * per_sample / 1e9:.3g} GFLOP, {credit_for(16, per_sample):.3g} credit" in receipts[0]
    assert agent.status.credit == pytest.approx(credit_for(16 + 7, per_sample))


@pytest.mark.parametrize(
    ("verification", "says"),
    [("pending", "credit pending verification (another"), ("check", "0 credit (copies are not credited)")],
)
async def test_a_receipt_says_credit_once_whatever_verification_says(
    world: World, config: AgentConfig, caplog: pytest.LogCaptureFixture, verification: str, says: str
) -> None:
    # It read "43.5 credit credit pending verification".
    world.site.replies = [world.lease(1, LEASE_1)]
    world.site.verification = verification
    agent = Agent(replace(config, max_leases=1), backoff=FAST_BACKOFF, benchmark_s=0.01)

    with caplog.at_level(logging.INFO, logger="crowdtrain_agent"):
        assert await agent.run() == 0

    (receipt,) = [r.getMessage() for r in caplog.records if " done: " in r.getMessage()]
    assert says in receipt and "credit credit" not in receipt, receipt


async def test_a_sync_agent_holds_the_parameters_its_model_reads_once_not_twice(
    world: World, config: AgentConfig
) -> None:
    # The base of the next delta download is the version the model was loaded with. A model in sync mode
    # only reads its parameters, so the store keeps that very tensor: a copy cost one model's size.
    lease = world.lease(1, LEASE_2)
    world.site.replies = [lease]
    agent = Agent(replace(config, max_leases=1), backoff=FAST_BACKOFF, benchmark_s=0.01)

    assert await agent.run() == 0

    held = agent._downloaded.exactly(7, world.params.numel(), 0)
    model = agent._models.get(7, lease.model).model
    assert held is not None and held.flat.data_ptr() == next(model.parameters()).data_ptr()
    assert torch.equal(held.flat, world.params)  # what the aggregators published, after the lease's compute
