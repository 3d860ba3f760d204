"""AdamW, SGD and LAMB with a warmup + cosine schedule: aggregator slices match plain PyTorch on the same gradients."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from crowdtrain_agent.models import get_model
from crowdtrain_agent.protocol import OptimizerSpec
from crowdtrain_backbone.checkpoints import LocalStore, load_checkpoint, save_checkpoint
from crowdtrain_backbone.lamb import Lamb
from crowdtrain_backbone.slices import MemoryBudget, PendingUpload, SliceState, initial_params, slice_segments

from .conftest import MLP, MLP_PARAMS, SLICE0, SLICE1, assignment, decay_groups, gradient, set_mean_gradient

# The MLP's tensors are 32 + 8 + 24 + 3 elements; these three slices hold whole tensors.
LAMB_SLICES = [(0, 32), (32, 40), (40, MLP_PARAMS)]
SCHEDULE = {"warmup_steps": 2, "schedule": "cosine", "total_steps": 6, "min_lr_ratio": 0.1}

Leases = dict[int, tuple[torch.Tensor, int]]


def _slices(spec: OptimizerSpec, bounds: list[tuple[int, int]]) -> list[SliceState]:
    states = []
    for index, b in enumerate(bounds):
        order = assignment(bounds=b, slice_index=index, optimizer=spec, staleness=10)
        states.append(SliceState(order, initial_params(order), 0, MemoryBudget(1 << 30)))
    return states


def _step(state: SliceState, leases: Leases) -> None:
    start, end = state.assignment.start, state.assignment.end
    for lease_id, (grad, n) in leases.items():
        state.add_pending(PendingUpload(lease_id, state.version, n, grad[start:end].clone()))
    num_samples = sum(n for _, n in leases.values())
    state.finish_step(state.apply_step_(state.collect(list(leases), num_samples), num_samples), list(leases))


def _steps(count: int = 6) -> list[Leases]:
    return [
        {lease: (gradient(MLP_PARAMS, 100 * step + lease), 1 + lease % 3) for lease in (10 * step + 1, 10 * step + 2)}
        for step in range(count)
    ]


def _reference(optimizer: torch.optim.Optimizer, model: torch.nn.Module, spec: OptimizerSpec) -> torch.Tensor:
    """The big machine: every step's mean gradient on the whole model, the rate set by PyTorch's LambdaLR."""
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, spec.lr_multiplier)
    params = list(model.parameters())
    for leases in _steps():
        set_mean_gradient(params, leases)
        optimizer.step()
        scheduler.step()
    return torch.nn.utils.parameters_to_vector(params).detach()


def _train(states: list[SliceState]) -> torch.Tensor:
    for leases in _steps():
        for state in states:
            _step(state, leases)
    return torch.cat([s.param.detach() for s in states])


def test_adamw_slices_with_warmup_and_cosine_match_the_full_model() -> None:
    spec = OptimizerSpec(name="adamw", lr=1e-2, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1, **SCHEDULE)
    model = get_model("mlp").build(MLP.config, seed=1234)
    full = torch.optim.AdamW(decay_groups(model, 0.1), lr=spec.lr, betas=(0.8, 0.99), eps=1e-6, foreach=False)

    got = _train(_slices(spec, [SLICE0, SLICE1]))

    torch.testing.assert_close(got, _reference(full, model, spec), rtol=0, atol=1e-7)


def test_sgd_momentum_slices_with_warmup_and_cosine_match_the_full_model() -> None:
    spec = OptimizerSpec(name="sgd", lr=0.1, momentum=0.9, weight_decay=0.01, **SCHEDULE)
    model = get_model("mlp").build(MLP.config, seed=1234)
    full = torch.optim.SGD(decay_groups(model, 0.01), lr=spec.lr, momentum=0.9, foreach=False)

    got = _train(_slices(spec, [SLICE0, SLICE1]))

    torch.testing.assert_close(got, _reference(full, model, spec), rtol=0, atol=1e-7)


def test_nesterov_sgd_slices_match_the_full_model_and_differ_from_heavy_ball() -> None:
    # DiLoCo's outer optimizer; without weight decay, as local campaigns use it.
    spec = OptimizerSpec(name="sgd", lr=0.7, momentum=0.9, nesterov=True, **SCHEDULE)
    model = get_model("mlp").build(MLP.config, seed=1234)
    full = torch.optim.SGD(model.parameters(), lr=spec.lr, momentum=0.9, nesterov=True, foreach=False)

    got = _train(_slices(spec, [SLICE0, SLICE1]))
    heavy_ball = _train(_slices(OptimizerSpec(name="sgd", lr=0.7, momentum=0.9, **SCHEDULE), [SLICE0, SLICE1]))

    torch.testing.assert_close(got, _reference(full, model, spec), rtol=0, atol=1e-6)
    assert not torch.allclose(got, heavy_ball, rtol=0, atol=1e-6)


def test_lamb_slices_compute_the_trust_ratio_of_each_whole_tensor() -> None:
    spec = OptimizerSpec(name="lamb", lr=5e-2, beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.01, **SCHEDULE)
    model = get_model("mlp").build(MLP.config, seed=1234)
    full = Lamb(decay_groups(model, 0.01), lr=spec.lr, betas=(0.9, 0.99), eps=1e-6)

    got = _train(_slices(spec, LAMB_SLICES))

    torch.testing.assert_close(got, _reference(full, model, spec), rtol=0, atol=1e-6)


def test_lamb_with_one_trust_ratio_per_slice_would_not_match() -> None:
    # Guards the test above: if segments were ignored, the slices would drift from the reference.
    spec = OptimizerSpec(name="lamb", lr=5e-2, **SCHEDULE)  # no weight decay: each slice is one piece
    model = get_model("mlp").build(MLP.config, seed=1234)
    full = Lamb(model.parameters(), lr=spec.lr, eps=spec.eps)
    states = _slices(spec, [SLICE0, SLICE1])
    for state in states:  # one trust ratio for the whole slice (two tensors) instead of one per tensor
        for group in state.optimizer.param_groups:
            group["segments"], group["decayed"] = [[param.numel()] for param in group["params"]], None

    got = _train(states)

    assert (got - _reference(full, model, spec)).abs().max() > 1e-4


def test_the_schedule_resumes_from_a_checkpoint_where_it_stopped(tmp_path: Path) -> None:
    spec = OptimizerSpec(name="lamb", lr=5e-2, weight_decay=0.01, **SCHEDULE)
    steps = _steps()
    straight = _slices(spec, [SLICE0])[0]
    for leases in steps:
        _step(straight, leases)
    first = _slices(spec, [SLICE0])[0]
    for leases in steps[:3]:
        _step(first, leases)

    save_checkpoint(LocalStore(tmp_path), 1, 0, first.version, first.checkpoint_dict())
    saved = load_checkpoint(
        LocalStore(tmp_path), 1, 0, 3
    )  # weights_only: LAMB's state must be plain tensors and numbers
    resumed = SliceState(first.assignment, saved["params"], saved["version"], MemoryBudget(1 << 30), saved["optimizer"])
    for leases in steps[3:]:
        _step(resumed, leases)

    assert resumed.version == straight.version == 6
    torch.testing.assert_close(resumed.param.detach(), straight.param.detach(), rtol=0, atol=0)
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(spec.lr * spec.lr_multiplier(5))


def test_each_step_runs_at_its_scheduled_rate() -> None:
    spec = OptimizerSpec(name="sgd", lr=0.5, **SCHEDULE)
    state = _slices(spec, [(0, 3)])[0]
    rates = []

    for step in range(8):
        before = state.param.detach().clone()
        state.add_pending(PendingUpload(step, state.version, 1, torch.ones(3)))
        state.finish_step(state.apply_step_(state.collect([step], 1), 1), [step])
        rates.append(float((before - state.param.detach())[0]))

    expected = [0.5 * spec.lr_multiplier(s) for s in range(8)]
    assert rates == pytest.approx(expected, rel=1e-5)
    assert rates[0] == pytest.approx(0.25) and rates[6] == pytest.approx(0.05) and rates[7] == pytest.approx(0.05)


def test_a_lamb_slice_that_cuts_a_tensor_is_refused() -> None:
    order = assignment(bounds=(0, 35), optimizer=OptimizerSpec(name="lamb"))

    with pytest.raises(ValueError, match="cuts the tensor at 32:40"):
        slice_segments(order)


def test_a_lamb_slice_knows_the_tensors_it_holds() -> None:
    order = assignment(bounds=(32, MLP_PARAMS), optimizer=OptimizerSpec(name="lamb"))

    assert slice_segments(order) == [8, 24, 3]
