"""The aggregation math of SliceState: slices compose to the full model, lease order is fixed, samples weigh."""

from __future__ import annotations

import torch

from crowdtrain_agent.models import get_model
from crowdtrain_agent.protocol import OptimizerSpec
from crowdtrain_backbone.slices import MemoryBudget, PendingUpload, SliceState, initial_params

from .conftest import MLP, MLP_PARAMS, SLICE0, SLICE1, assignment, decay_groups, gradient, set_mean_gradient


def _slice(bounds: tuple[int, int], optimizer: OptimizerSpec, slice_index: int = 0) -> SliceState:
    order = assignment(bounds=bounds, slice_index=slice_index, optimizer=optimizer, staleness=10)
    return SliceState(order, initial_params(order), 0, MemoryBudget(1 << 30))


def _step(state: SliceState, leases: dict[int, tuple[torch.Tensor, int]]) -> None:
    start = state.assignment.start
    for lease_id, (grad, n) in leases.items():
        state.add_pending(PendingUpload(lease_id, state.version, n, grad[start : state.assignment.end].clone()))
    num_samples = sum(n for _, n in leases.values())
    uploads = state.collect(list(leases), num_samples)
    state.finish_step(state.apply_step_(uploads, num_samples), list(leases))


def _full_model_steps(optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                      steps: list[dict[int, tuple[torch.Tensor, int]]]) -> torch.Tensor:  # fmt: skip
    params = list(model.parameters())
    for leases in steps:
        set_mean_gradient(params, leases)
        optimizer.step()
    return torch.nn.utils.parameters_to_vector(params).detach()


def _steps() -> list[dict[int, tuple[torch.Tensor, int]]]:
    return [
        {lease: (gradient(MLP_PARAMS, 100 * step + lease), 1 + lease % 3) for lease in leases}
        for step, leases in enumerate([[3, 1, 2], [5, 4], [9, 7, 8, 6]])
    ]


def test_two_slices_compose_to_exactly_one_aggregator_holding_the_whole_vector() -> None:
    spec = OptimizerSpec(name="adamw", lr=1e-2, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1)
    whole = _slice((0, MLP_PARAMS), spec)
    first, second = _slice(SLICE0, spec), _slice(SLICE1, spec, slice_index=1)

    for leases in _steps():
        for state in (whole, first, second):
            _step(state, leases)

    assert torch.equal(torch.cat([first.param.detach(), second.param.detach()]), whole.param.detach())
    assert first.version == second.version == whole.version == 3


def test_sliced_adamw_steps_match_plain_pytorch_adamw_on_the_whole_model() -> None:
    spec = OptimizerSpec(name="adamw", lr=1e-2, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1)
    model = get_model("mlp").build(MLP.config, seed=1234)
    full_optimizer = torch.optim.AdamW(decay_groups(model, 0.1), lr=1e-2, betas=(0.8, 0.99), eps=1e-6)
    first, second = _slice(SLICE0, spec), _slice(SLICE1, spec, slice_index=1)

    for leases in _steps():
        _step(first, leases)
        _step(second, leases)
    expected = _full_model_steps(full_optimizer, model, _steps())

    # The aggregator's fused kernel rounds a few elements differently from the reference loop (1 ulp).
    torch.testing.assert_close(torch.cat([first.param.detach(), second.param.detach()]), expected, rtol=1e-6, atol=0)


def test_two_slices_compose_to_the_full_model_sgd_momentum_step() -> None:
    spec = OptimizerSpec(name="sgd", lr=0.1, momentum=0.9, weight_decay=0.01)
    model = get_model("mlp").build(MLP.config, seed=1234)
    full_optimizer = torch.optim.SGD(decay_groups(model, 0.01), lr=0.1, momentum=0.9)
    first, second = _slice(SLICE0, spec), _slice(SLICE1, spec, slice_index=1)

    for leases in _steps():
        _step(first, leases)
        _step(second, leases)
    expected = _full_model_steps(full_optimizer, model, _steps())

    torch.testing.assert_close(torch.cat([first.param.detach(), second.param.detach()]), expected, rtol=0, atol=0)


def test_it_sums_leases_in_ascending_id_order_whatever_the_arrival_order() -> None:
    spec = OptimizerSpec(name="sgd", lr=1.0)
    bounds = (0, 3)
    # fp32 addition is not associative with these magnitudes: order shows in the low bits.
    grads = {1: torch.tensor([1e8, 1.0, 3.3]), 2: torch.tensor([1.0, 1e8, -7.1]), 3: torch.tensor([-1e8, -1e8, 0.3])}
    a, b = _slice(bounds, spec), _slice(bounds, spec)
    start = a.param.detach().clone()

    for lease_id in (3, 1, 2):
        a.add_pending(PendingUpload(lease_id, 0, 1, grads[lease_id]))
    for lease_id in (2, 3, 1):
        b.add_pending(PendingUpload(lease_id, 0, 1, grads[lease_id]))
    a.finish_step(a.apply_step_(a.collect([2, 3, 1], 3), 3), [2, 3, 1])
    b.finish_step(b.apply_step_(b.collect([1, 2, 3], 3), 3), [1, 2, 3])

    ascending = (torch.zeros(3) + grads[1] + grads[2] + grads[3]) / 3
    assert torch.equal(a.param.detach(), b.param.detach())
    assert torch.equal(a.param.detach(), start - ascending)


def test_it_weights_contributions_by_samples() -> None:
    state = _slice((0, 2), OptimizerSpec(name="sgd", lr=1.0))
    start = state.param.detach().clone()

    state.add_pending(PendingUpload(1, 0, 1, torch.tensor([1.0, 1.0])))  # one sample, gradient 1
    state.add_pending(PendingUpload(2, 0, 3, torch.tensor([12.0, 12.0])))  # three samples of gradient 4
    state.finish_step(state.apply_step_(state.collect([1, 2], 4), 4), [1, 2])

    torch.testing.assert_close(state.param.detach(), start - torch.tensor([3.25, 3.25]))


def test_the_same_seed_gives_every_aggregator_the_same_initial_slice() -> None:
    order = assignment(bounds=SLICE1, slice_index=1)

    first, second = initial_params(order), initial_params(order)

    model = get_model("mlp").build(MLP.config, seed=order.seed)
    torch.testing.assert_close(first, torch.nn.utils.parameters_to_vector(model.parameters())[SLICE1[0] : SLICE1[1]])
    assert torch.equal(first, second)


def test_version_zero_of_any_slice_is_those_elements_of_the_seeded_model() -> None:
    whole = torch.nn.utils.parameters_to_vector(get_model("mlp").build(MLP.config, seed=1234).parameters()).detach()

    # Cuts inside a tensor, on a tensor's edge, one element, the whole vector.
    for bounds in [(0, MLP_PARAMS), (3, 40), (32, 40), (40, 41), (50, MLP_PARAMS)]:
        got = initial_params(assignment(bounds=bounds))
        assert torch.equal(got.view(torch.int32), whole[bounds[0] : bounds[1]].view(torch.int32)), bounds
