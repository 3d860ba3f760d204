"""Weight decay reaches matrices and embeddings only, per model tensor, so slices still compose bit for bit."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crowdtrain_agent.models import get_model
from crowdtrain_agent.protocol import ModelSpec, OptimizerSpec
from crowdtrain_backbone import optimizers
from crowdtrain_backbone.checkpoints import LocalStore, load_checkpoint, save_checkpoint
from crowdtrain_backbone.lamb import Lamb
from crowdtrain_backbone.optimizers import decay_rule, tensor_spans
from crowdtrain_backbone.slices import MemoryBudget, PendingUpload, SliceState, initial_params

from .conftest import assignment, decay_groups, gradient, set_mean_gradient

GPT = ModelSpec(architecture="gpt", config={"n_layer": 1, "n_head": 1, "n_embd": 8, "block_size": 8})
# Tensors of 1073, 29, 377, 13, 39 and 3 elements: every boundary falls off the kernels' vector width.
ODD_MLP = ModelSpec(architecture="mlp", config={"in_dim": 37, "hidden": [29, 13], "classes": 3})
# The fused kernels round the last (numel % vector width) elements of their input in a scalar loop:
# cuts on multiples of 16 floats (AVX-512; 8 with AVX2) keep every element on the same path.
ALIGN = 16

SPECS = {
    "adamw": OptimizerSpec(name="adamw", lr=1e-2, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1),
    "sgd": OptimizerSpec(name="sgd", lr=0.1, momentum=0.9, weight_decay=0.05),
    "lamb": OptimizerSpec(name="lamb", lr=1e-2, weight_decay=0.05),
}


def numel(model: ModelSpec) -> int:
    return get_model(model.architecture).param_count(model.config)


def tensor_edges(model: ModelSpec) -> list[int]:
    sizes = [math.prod(s) for s in get_model(model.architecture).param_shapes(model.config)]
    return [sum(sizes[:i]) for i in range(1, len(sizes))]


def train(model: ModelSpec, spec: OptimizerSpec, cuts: list[int], steps: int = 3) -> torch.Tensor:
    """``steps`` steps on slices cut at ``cuts``; the slices' parameters laid end to end."""
    n = numel(model)
    edges = [0, *cuts, n]
    states = []
    for index, bounds in enumerate(itertools.pairwise(edges)):
        order = assignment(bounds=bounds, slice_index=index, optimizer=spec, staleness=10, model=model, param_count=n)
        states.append(SliceState(order, initial_params(order), 0, MemoryBudget(1 << 30)))
    for step in range(steps):
        grad = gradient(n, step)
        for state in states:
            start, end = state.assignment.start, state.assignment.end
            state.add_pending(PendingUpload(step, state.version, 2, grad[start:end].clone()))
            state.finish_step(state.apply_step_(state.collect([step], 2), 2), [step])
    return torch.cat([state.param.detach() for state in states])


def reference(model: ModelSpec, spec: OptimizerSpec, *, decay_all: bool = False, steps: int = 3) -> torch.Tensor:
    """Plain PyTorch on the whole model: one param group per decay rule, as nanoGPT builds them."""
    net = get_model(model.architecture).build(model.config, seed=1234)
    groups = decay_groups(net, spec.weight_decay, decay_all=decay_all)
    opt: torch.optim.Optimizer
    if spec.name == "adamw":
        opt = torch.optim.AdamW(groups, lr=spec.lr, betas=(spec.beta1, spec.beta2), eps=spec.eps, foreach=False)
    elif spec.name == "sgd":
        opt = torch.optim.SGD(groups, lr=spec.lr, momentum=spec.momentum, foreach=False)
    else:
        opt = Lamb(groups, lr=spec.lr, betas=(spec.beta1, spec.beta2), eps=spec.eps)
    params = list(net.parameters())
    for step in range(steps):
        set_mean_gradient(params, {step: (gradient(numel(model), step), 2)})
        opt.step()
    return torch.nn.utils.parameters_to_vector(params).detach()


def test_a_step_without_gradient_decays_the_matrices_and_nothing_else() -> None:
    spec = OptimizerSpec(name="adamw", lr=0.1, weight_decay=0.5)
    order = assignment(bounds=(0, numel(GPT)), optimizer=spec, model=GPT, param_count=numel(GPT))
    state = SliceState(order, initial_params(order), 0, MemoryBudget(1 << 30))
    before = state.param.detach().clone()
    spans = tensor_spans(get_model("gpt").param_shapes(GPT.config), 0, numel(GPT))

    state.add_pending(PendingUpload(1, 0, 1, torch.zeros(numel(GPT))))
    state.finish_step(state.apply_step_(state.collect([1], 1), 1), [1])

    after = state.param.detach()
    for span, decayed in zip(spans, decay_rule(spans), strict=True):
        expected = before[span.start : span.end] * (1 - 0.1 * 0.5) if decayed else before[span.start : span.end]
        assert torch.equal(after[span.start : span.end], expected), span
    assert sum(decay_rule(spans)) == 6 and len(spans) == 16  # wte, wpe, qkv, proj, fc, fc_proj


@pytest.mark.parametrize("name", ["adamw", "sgd", "lamb"])
@pytest.mark.parametrize("model", [GPT, ODD_MLP], ids=["gpt", "odd-mlp"])
def test_slices_match_plain_pytorch_with_one_param_group_per_decay_rule(name: str, model: ModelSpec) -> None:
    spec = SPECS[name]
    cuts = tensor_edges(model)[1::2]  # whole tensors, which LAMB needs; AdamW and SGD do not care

    got = train(model, spec, cuts)

    # The fused kernels and PyTorch's reference loop round a few elements apart (1 ulp).
    torch.testing.assert_close(got, reference(model, spec), rtol=1e-6, atol=1e-7)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(["adamw", "sgd"]),
    st.lists(st.integers(1, (numel(ODD_MLP) - 1) // ALIGN), min_size=1, max_size=3, unique=True),
)
def test_aligned_slices_compose_bit_for_bit_with_one_aggregator_holding_everything(name: str, units: list[int]) -> None:
    cuts = sorted(ALIGN * u for u in units)

    assert torch.equal(train(ODD_MLP, SPECS[name], cuts), train(ODD_MLP, SPECS[name], []))


@settings(max_examples=10, deadline=None)
@given(st.lists(st.sampled_from(tensor_edges(ODD_MLP)), min_size=1, max_size=3, unique=True))
def test_lamb_slices_of_whole_tensors_compose_bit_for_bit(cuts: list[int]) -> None:
    assert torch.equal(train(ODD_MLP, SPECS["lamb"], sorted(cuts)), train(ODD_MLP, SPECS["lamb"], []))


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_a_campaign_may_decay_every_tensor(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # decay_all reaches the aggregator once OptimizerSpec carries it; its effect is tested here directly.
    real = optimizers.hyperparameters_of

    def decaying_all(spec: OptimizerSpec) -> dict[str, Any]:
        return {**real(spec), "decay_all": True}

    monkeypatch.setattr(optimizers, "hyperparameters_of", decaying_all)

    got = train(GPT, SPECS[name], [])

    torch.testing.assert_close(got, reference(GPT, SPECS[name], decay_all=True), rtol=1e-6, atol=1e-7)
    assert not torch.equal(got, reference(GPT, SPECS[name]))


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_a_slice_resumed_from_a_checkpoint_decays_as_before(name: str, tmp_path: Path) -> None:
    spec = SPECS[name]
    straight = train(ODD_MLP, spec, [], steps=4)
    n = numel(ODD_MLP)
    order = assignment(bounds=(0, n), optimizer=spec, staleness=10, model=ODD_MLP, param_count=n)
    first = SliceState(order, initial_params(order), 0, MemoryBudget(1 << 30))
    for step in range(2):
        first.add_pending(PendingUpload(step, step, 2, gradient(n, step)))
        first.finish_step(first.apply_step_(first.collect([step], 2), 2), [step])

    save_checkpoint(LocalStore(tmp_path), 1, 0, 2, first.checkpoint_dict())
    saved = load_checkpoint(LocalStore(tmp_path), 1, 0, 2)
    resumed = SliceState(order, saved["params"], 2, MemoryBudget(1 << 30), saved["optimizer"])
    for step in range(2, 4):
        resumed.add_pending(PendingUpload(step, step, 2, gradient(n, step)))
        resumed.finish_step(resumed.apply_step_(resumed.collect([step], 2), 2), [step])

    assert torch.equal(resumed.param.detach(), straight)
    assert len(saved["optimizer"]["param_groups"]) == 1  # one flat parameter, as checkpoints always held


def test_a_lamb_checkpoint_from_before_decay_flags_still_loads() -> None:
    spec = SPECS["lamb"]
    n = numel(ODD_MLP)
    order = assignment(bounds=(0, n), optimizer=spec, staleness=10, model=ODD_MLP, param_count=n)
    state = SliceState(order, initial_params(order), 0, MemoryBudget(1 << 30))
    state.add_pending(PendingUpload(1, 0, 2, gradient(n, 0)))
    state.finish_step(state.apply_step_(state.collect([1], 2), 2), [1])
    old = state.optimizer.state_dict()
    del old["param_groups"][0]["decayed"]  # what a checkpoint written before this option holds

    state.install_(state.param.detach(), state.version, old)
    state.add_pending(PendingUpload(2, 1, 2, gradient(n, 1)))
    state.finish_step(state.apply_step_(state.collect([2], 2), 2), [2])

    assert state.optimizer.param_groups[0]["decayed"] == [[True, False, True, False, True, False]]
    assert torch.equal(state.param.detach(), train(ODD_MLP, spec, [], steps=2))
