"""Local-steps leases on the agent: inner steps, the pseudo-gradient, the kept and the dropped inner state.

An overlapped lease (``rebase_to``) starts from the agent's own estimate of
its round's base and moves onto the exact version between inner steps when
it arrives; what it uploads is its movement from that version.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

import msgspec
import pytest
import torch

from crowdtrain_agent.config import AgentConfig
from crowdtrain_agent.local_steps import (
    InnerOptimizers,
    RebaseFailed,
    RoundBase,
    build_inner_optimizer,
    compute_pseudo_gradient,
    local_lease_problem,
)
from crowdtrain_agent.protocol import LeaseDone, LeaseRelease, ModelSpec, OptimizerSpec
from crowdtrain_agent.runtime import Agent
from crowdtrain_agent.trainer import CampaignModel, ComputeCancelled, ModelCache

from .conftest import FAST_BACKOFF
from .fakes import World

MODEL = ModelSpec(architecture="mlp", config={"in_dim": 8, "hidden": [16], "classes": 3})
INNER = OptimizerSpec(name="adamw", lr=1e-2, weight_decay=0.1)


def model() -> CampaignModel:
    torch.manual_seed(0)
    return ModelCache(torch.device("cpu")).get(1, MODEL)


def data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def flat(cm: CampaignModel) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(cm.model.parameters()).detach().clone()


def plain_adamw(cm: CampaignModel, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Plain PyTorch on a copy: one AdamW step per microbatch on its mean loss, decay on matrices only."""
    copy = ModelCache(torch.device("cpu")).get(2, MODEL)
    torch.nn.utils.vector_to_parameters(flat(cm), copy.model.parameters())
    params = list(copy.model.parameters())
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": INNER.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=INNER.lr,
        foreach=False,
    )
    for x, y in batches:
        optimizer.zero_grad()
        (copy.entry.loss_sum(copy.model, x, y) / len(x)).backward()
        optimizer.step()
    return flat(copy)


@pytest.mark.parametrize("microbatches", [1, 3])
def test_the_pseudo_gradient_is_the_change_of_h_inner_steps_times_the_samples(microbatches: int) -> None:
    cm = model()
    base = flat(cm)
    x, y = data(4 * microbatches, seed=1)
    optimizer = InnerOptimizers().get(1, cm, INNER, base_version=0)
    result = compute_pseudo_gradient(cm, optimizer, INNER.lr, x, y, microbatch_size=4)
    expected = plain_adamw(cm, [(x[i : i + 4], y[i : i + 4]) for i in range(0, len(x), 4)])

    assert result.num_samples == len(x)
    torch.testing.assert_close(base - result.grad / len(x), expected, rtol=0, atol=1e-6)
    assert torch.equal(flat(cm), base), "the model is back on its base parameters"
    assert result.loss_sum > 0


@pytest.mark.parametrize("samples", [24, 20])  # whole inner batches, and a last inner step of what is left
def test_an_inner_batch_of_several_microbatches_takes_one_step_on_their_summed_gradients(samples: int) -> None:
    cm = model()
    base = flat(cm)
    x, y = data(samples, seed=2)
    optimizer = InnerOptimizers().get(1, cm, INNER, base_version=0)
    result = compute_pseudo_gradient(cm, optimizer, INNER.lr, x, y, microbatch_size=4, inner_batch_size=8)
    # Plain PyTorch holding each inner batch at once: one step per 8 samples (the last may hold fewer).
    expected = plain_adamw(cm, [(x[i : i + 8], y[i : i + 8]) for i in range(0, len(x), 8)])

    torch.testing.assert_close(base - result.grad / len(x), expected, rtol=0, atol=1e-6)
    one_per_microbatch = plain_adamw(cm, [(x[i : i + 4], y[i : i + 4]) for i in range(0, len(x), 4)])
    assert not torch.allclose(expected, one_per_microbatch, atol=1e-4), "the inner batch changes the steps"


def test_an_inner_batch_that_is_not_whole_microbatches_is_refused() -> None:
    cm = model()
    x, y = data(12, seed=3)
    optimizer = InnerOptimizers().get(1, cm, INNER, base_version=0)
    with pytest.raises(ValueError, match="not a positive multiple of the microbatch"):
        compute_pseudo_gradient(cm, optimizer, INNER.lr, x, y, microbatch_size=4, inner_batch_size=6)


def test_the_inner_state_carries_over_to_the_next_lease_of_the_campaign() -> None:
    cm = model()
    inner = InnerOptimizers()
    batches = [data(4, seed=s) for s in (1, 2, 3)]
    reference = plain_adamw(cm, batches)
    for version, (x, y) in enumerate(batches):  # each round: an outer SGD of lr 1 applies the pseudo-gradient
        optimizer = inner.get(1, cm, INNER, base_version=version)
        result = compute_pseudo_gradient(cm, optimizer, INNER.lr, x, y, microbatch_size=4)
        torch.nn.utils.vector_to_parameters(flat(cm) - result.grad / len(x), cm.model.parameters())
    torch.testing.assert_close(flat(cm), reference, rtol=0, atol=1e-6)


def test_a_cancelled_lease_leaves_the_model_on_its_base_parameters() -> None:
    cm = model()
    base = flat(cm)
    cancel = threading.Event()
    cancel.set()
    optimizer = InnerOptimizers().get(1, cm, INNER, base_version=0)
    x, y = data(8, seed=1)
    with pytest.raises(ComputeCancelled):
        compute_pseudo_gradient(cm, optimizer, INNER.lr, x, y, microbatch_size=4, cancel=cancel)
    assert torch.equal(flat(cm), base)


@pytest.mark.parametrize(("next_version", "why"), [(19 + 17, "more than 16 steps on"), (1, "a rollback")])
def test_the_inner_state_is_dropped_with_a_reason_when_the_agent_fell_behind(
    next_version: int, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    cm = model()
    inner = InnerOptimizers(max_lag=16)
    first = inner.get(1, cm, INNER, base_version=3)
    assert inner.get(1, cm, INNER, base_version=19) is first, "16 steps on, the state is kept"
    with caplog.at_level(logging.INFO, logger="crowdtrain_agent.local_steps"):
        again = inner.get(1, cm, INNER, base_version=next_version)
    assert again is not first
    assert why in caplog.text and "starting the inner optimizer afresh" in caplog.text


def test_a_new_learning_rate_keeps_the_state_but_other_settings_do_not() -> None:
    cm = model()
    inner = InnerOptimizers()
    first = inner.get(1, cm, INNER, base_version=0)
    assert inner.get(1, cm, msgspec.structs.replace(INNER, lr=5e-3), base_version=1) is first
    assert inner.get(1, cm, msgspec.structs.replace(INNER, beta2=0.95), base_version=2) is not first
    assert inner.get(2, cm, INNER, base_version=0) is not inner.get(1, cm, INNER, base_version=2)


def test_sgd_inner_optimizers_take_nesterov_and_lamb_is_refused_with_what_to_do() -> None:
    cm = model()
    sgd = build_inner_optimizer(cm.model, OptimizerSpec(name="sgd", lr=0.1, momentum=0.9, nesterov=True))
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["nesterov"]
    # The CPU has fused kernels for both: a fused inner step costs a tenth of torch's default per-tensor loop.
    assert sgd.defaults["fused"] and build_inner_optimizer(cm.model, INNER).defaults["fused"]
    with pytest.raises(ValueError, match="upgrade crowdtrain-agent"):
        build_inner_optimizer(cm.model, OptimizerSpec(name="lamb"))


async def test_which_local_leases_an_agent_refuses_before_downloading_anything(world: World) -> None:
    assert local_lease_problem(world.lease(1, [(0, 4)])) == ""
    assert local_lease_problem(world.lease(1, [(0, 4)], mode="local", inner=INNER)) == ""
    assert "without an inner optimizer" in local_lease_problem(world.lease(1, [(0, 4)], mode="local"))
    lamb = world.lease(1, [(0, 4)], mode="local", inner=OptimizerSpec(name="lamb"))
    assert "not one this agent runs" in local_lease_problem(lamb)
    odd = msgspec.structs.replace(world.lease(1, [(0, 8)], microbatch=4, mode="local", inner=INNER), inner_batch_size=6)
    assert "not a positive multiple of its microbatch of 4" in local_lease_problem(odd)


async def test_a_local_lease_uploads_its_pseudo_gradient_and_the_next_keeps_the_moments(
    world: World, config: AgentConfig
) -> None:
    ranges_1, ranges_2 = [(0, 8)], [(8, 8)]
    world.site.replies = [
        world.lease(1, ranges_1, microbatch=4, mode="local", inner=INNER),
        world.lease(2, ranges_2, microbatch=4, mode="local", inner=INNER),
    ]
    await Agent(config, backoff=FAST_BACKOFF, benchmark_s=0.01).run()

    # Both leases start from version 0 (the fake aggregators publish nothing new): the second one's
    # inner steps run on the moments the first left, from the same base parameters.
    cm = ModelCache(torch.device("cpu")).get(2, world.lease(1, ranges_1).model)
    torch.nn.utils.vector_to_parameters(world.params.clone(), cm.model.parameters())
    inner = InnerOptimizers()
    for lease_id, ranges in ((1, ranges_1), (2, ranges_2)):
        x, y = world.samples(ranges)
        expected = compute_pseudo_gradient(cm, inner.get(1, cm, INNER, 0), INNER.lr, x, y, microbatch_size=4).grad
        uploaded = torch.cat([world.aggregators[0].uploads[(lease_id, 0)], world.aggregators[1].uploads[(lease_id, 1)]])
        torch.testing.assert_close(uploaded, expected)
    assert not torch.allclose(uploaded, world.expected_gradient(ranges_2)), "a pseudo-gradient, not a gradient"
    done = world.site.of_kind(LeaseDone)
    assert [d.num_samples for d in done] == [8, 8]


async def test_a_local_lease_the_agent_cannot_run_is_given_back_unworked(world: World, config: AgentConfig) -> None:
    world.site.replies = [
        world.lease(1, [(0, 8)], mode="local", inner=OptimizerSpec(name="lamb")),
        world.lease(2, [(8, 8)]),
    ]
    await Agent(config, backoff=FAST_BACKOFF, benchmark_s=0.01).run()

    assert [m.lease_id for m in world.site.of_kind(LeaseRelease)] == [1]
    assert [d.lease_id for d in world.site.of_kind(LeaseDone)] == [2]
    assert all(agg.param_downloads <= 1 for agg in world.aggregators)


class ArrivesAfter(RoundBase):
    """A round base whose parameters the compute finds only after ``polls`` looks (a download that takes a while)."""

    def __init__(self, flat: torch.Tensor, polls: int) -> None:
        super().__init__(version=1)
        self.deliver(flat)
        self.polls = polls

    def poll(self) -> torch.Tensor | None:
        if self.polls > 0:
            self.polls -= 1
            return None
        return super().poll()


def shifted_adamw(
    cm: CampaignModel,
    start: torch.Tensor,
    exact: torch.Tensor,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    shift_before: int,
) -> torch.Tensor:
    """Plain PyTorch: AdamW steps from ``start``; before step ``shift_before`` the parameters move by exact - start."""
    copy = ModelCache(torch.device("cpu")).get(2, MODEL)
    torch.nn.utils.vector_to_parameters(start.clone(), copy.model.parameters())
    params = list(copy.model.parameters())
    optimizer = build_inner_optimizer(copy.model, INNER)
    for index in range(len(batches) + 1):
        if index == shift_before:
            with torch.no_grad():
                for p, d in zip(params, torch.split(exact - start, [p.numel() for p in params]), strict=True):
                    p.add_(d.view_as(p))
        if index == len(batches):
            break
        x, y = batches[index]
        optimizer.zero_grad()
        (copy.entry.loss_sum(copy.model, x, y) / len(x)).backward()
        optimizer.step()
    return flat(copy)


@pytest.mark.parametrize("arrives_before", [0, 1, 3])  # before the first inner step, between, after the last
def test_an_overlapped_lease_moves_onto_its_round_base_when_it_arrives(arrives_before: int) -> None:
    cm = model()
    base = flat(cm)
    start = base + 0.05 * torch.randn(base.numel(), generator=torch.Generator().manual_seed(4))  # its own estimate
    exact = base + 0.03 * torch.randn(base.numel(), generator=torch.Generator().manual_seed(5))  # what was published
    x, y = data(12, seed=6)
    optimizer = InnerOptimizers().get(1, cm, INNER, base_version=0)
    result = compute_pseudo_gradient(
        cm, optimizer, INNER.lr, x, y, microbatch_size=4, start=start, rebase=ArrivesAfter(exact, arrives_before)
    )
    batches = [(x[i : i + 4], y[i : i + 4]) for i in range(0, 12, 4)]
    final = shifted_adamw(cm, start, exact, batches, shift_before=arrives_before)

    torch.testing.assert_close(exact - result.grad / len(x), final, rtol=0, atol=1e-6)
    assert result.final_params is not None
    torch.testing.assert_close(result.final_params, final, rtol=0, atol=1e-6)
    assert torch.equal(flat(cm), base), "the model is back on its base version"
    # Only the inner steps taken before the version arrived ran at the estimate: arriving first is no estimate.
    from_exact = shifted_adamw(cm, exact, exact, batches, shift_before=0)
    assert torch.allclose(final, from_exact, atol=1e-6) == (arrives_before == 0)


def test_a_round_base_that_arrives_while_the_last_step_is_done_is_waited_for_and_not_counted_as_compute() -> None:
    cm = model()
    exact = flat(cm) + 0.01
    target = RoundBase(1)
    x, y = data(4, seed=2)
    optimizer = InnerOptimizers().get(1, cm, INNER, base_version=0)
    threading.Timer(0.3, target.deliver, args=(exact,)).start()

    result = compute_pseudo_gradient(cm, optimizer, INNER.lr, x, y, microbatch_size=4, rebase=target)

    assert result.rebase_wait_s >= 0.2 and result.compute_s < result.rebase_wait_s
    torch.testing.assert_close(exact - result.grad / len(x), shifted_adamw(cm, flat(cm), exact, [(x, y)], 1))


def test_a_round_base_that_never_comes_or_fails_gives_the_lease_back_with_the_reason() -> None:
    cm = model()
    base = flat(cm)
    x, y = data(4, seed=2)
    optimizer = InnerOptimizers().get(1, cm, INNER, base_version=0)
    with pytest.raises(RebaseFailed, match="version 3, the base of this lease's round, was not published within"):
        compute_pseudo_gradient(
            cm, optimizer, INNER.lr, x, y, microbatch_size=4, rebase=RoundBase(3), rebase_wait_s=0.1
        )
    assert torch.equal(flat(cm), base)
    failed = RoundBase(3)
    failed.fail("HTTP 410 from the aggregator")
    with pytest.raises(RebaseFailed, match="version 3 .* missing: HTTP 410 from the aggregator"):
        compute_pseudo_gradient(cm, optimizer, INNER.lr, x, y, microbatch_size=4, rebase=failed)
    cancel = threading.Event()
    threading.Timer(0.1, cancel.set).start()
    with pytest.raises(ComputeCancelled):
        compute_pseudo_gradient(cm, optimizer, INNER.lr, x, y, microbatch_size=4, rebase=RoundBase(3), cancel=cancel)
    assert torch.equal(flat(cm), base)


def test_the_estimate_of_a_round_base_is_where_the_last_lease_of_the_round_before_ended() -> None:
    cm = model()
    inner = InnerOptimizers()
    inner.get(1, cm, INNER, base_version=0)
    ends = {r: torch.full((3,), float(r)) for r in range(4)}
    assert inner.estimate(1, 1) is None, "no lease of round 0 yet"
    for round_base, end in ends.items():
        inner.remember(1, round_base, end)
    assert inner.estimate(1, 4) is ends[3] and inner.estimate(1, 3) is ends[2]
    assert inner.estimate(1, 2) is None, "only the newest two rounds are kept"
    assert inner.estimate(2, 4) is None, "per campaign"


async def test_which_overlapped_leases_an_agent_refuses(world: World) -> None:
    overlapped = world.lease(1, [(0, 4)], mode="local", inner=INNER, rebase_to=1)
    assert local_lease_problem(overlapped) == "" and overlapped.round_base == 1
    backwards = world.lease(1, [(0, 4)], version=2, mode="local", inner=INNER, rebase_to=2)
    assert "not newer than its base version 2" in local_lease_problem(backwards)
    assert "only local-steps leases do" in local_lease_problem(world.lease(1, [(0, 4)], rebase_to=1))


async def test_an_overlapped_lease_uploads_its_movement_from_the_round_base_downloaded_once(
    world: World, config: AgentConfig
) -> None:
    version_1 = world.params + 0.02
    for index, (agg, (lo, hi)) in enumerate(
        zip(world.aggregators, [(0, world.split), (world.split, None)], strict=True)
    ):
        agg.params[(index, 1)] = version_1[lo:hi].numpy().astype("<f4").tobytes()
        agg.slow_versions[1] = 1.0  # published a second after the lease arrives: after its only inner step
    world.site.replies = [
        world.lease(1, [(0, 8)], microbatch=8, mode="local", inner=INNER),
        world.lease(2, [(8, 8)], microbatch=8, mode="local", inner=INNER, rebase_to=1),  # round 1, on version 0
        world.lease(3, [(16, 8)], version=1, microbatch=8, mode="local", inner=INNER),
    ]
    await Agent(dataclasses.replace(config, max_leases=3), backoff=FAST_BACKOFF, benchmark_s=0.01).run()

    cm = ModelCache(torch.device("cpu")).get(2, world.lease(1, [(0, 8)]).model)
    torch.nn.utils.vector_to_parameters(world.params.clone(), cm.model.parameters())
    inner = InnerOptimizers()
    first = compute_pseudo_gradient(cm, inner.get(1, cm, INNER, 0), INNER.lr, *world.samples([(0, 8)]), 8)
    # Lease 2 starts where lease 1 ended, takes its one inner step there, then moves onto version 1.
    second = compute_pseudo_gradient(
        cm, inner.get(1, cm, INNER, 0), INNER.lr, *world.samples([(8, 8)]), 8,
        start=first.final_params, rebase=ArrivesAfter(version_1, polls=1),
    )  # fmt: skip
    uploaded = torch.cat([world.aggregators[0].uploads[(2, 0)], world.aggregators[1].uploads[(2, 1)]])
    torch.testing.assert_close(uploaded, second.grad)
    naive = compute_pseudo_gradient(cm, InnerOptimizers().get(1, cm, INNER, 0), INNER.lr, *world.samples([(8, 8)]), 8)
    assert not torch.allclose(uploaded, naive.grad, atol=1e-4), "not a movement from its base version"
    assert [d.lease_id for d in world.site.of_kind(LeaseDone)] == [1, 2, 3]
    # Version 1 came down once, for lease 2; lease 3 (on version 1) only asked whether it was still current.
    assert [agg.param_downloads for agg in world.aggregators] == [2, 2]
