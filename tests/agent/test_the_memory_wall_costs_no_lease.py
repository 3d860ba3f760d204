"""Out of memory on a volunteer's device costs no lease: activation checkpointing, then smaller microbatches,
and the gradient is the same (checkpointing to 1e-6)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from crowdtrain_agent.models import get_model
from crowdtrain_agent.protocol import ModelSpec
from crowdtrain_agent.trainer import CampaignModel, ModelCache, compute_gradient, load_params_

LLAMA = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "block_size": 12}  # fmt: skip


def _model(arch: str = "llama", config: dict[str, Any] = LLAMA) -> CampaignModel:
    cm = ModelCache(torch.device("cpu")).get(1, ModelSpec(architecture=arch, config=config))
    params = torch.nn.utils.parameters_to_vector(get_model(arch).build(config, seed=5).parameters()).detach()
    load_params_(cm, params, version=3)
    return cm


def _tokens(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (n, LLAMA["block_size"] + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def _running_out_above(cm: CampaignModel, monkeypatch: pytest.MonkeyPatch, samples: int) -> list[int]:
    """The device holds at most ``samples`` per microbatch until activations are checkpointed, then twice as many."""
    tried: list[int] = []
    loss_sum = cm.entry.loss_sum

    def limited(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        tried.append(len(x))
        if len(x) > samples * (2 if cm.checkpointing else 1):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return loss_sum(model, x, y)

    monkeypatch.setattr(cm, "entry", dataclasses.replace(cm.entry, _loss_sum=limited))
    return tried


def test_activation_checkpointing_gives_the_same_gradient() -> None:
    x, y = _tokens()
    plain = compute_gradient(_model(), x, y, microbatch_size=4)
    checkpointed = _model()
    checkpointed.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})

    result = compute_gradient(checkpointed, x, y, microbatch_size=4)

    torch.testing.assert_close(result.grad, plain.grad, rtol=0, atol=1e-6)


def test_out_of_memory_checkpoints_then_halves_and_the_lease_still_gives_its_gradient(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x, y = _tokens()
    expected = compute_gradient(_model(), x, y, microbatch_size=8)
    cm = _model()
    tried = _running_out_above(cm, monkeypatch, samples=1)  # 2 with checkpointing

    result = compute_gradient(cm, x, y, microbatch_size=8)

    torch.testing.assert_close(result.grad, expected.grad, rtol=1e-5, atol=1e-6)
    assert (cm.checkpointing, cm.microbatch_cap, result.out_of_memory, cm.out_of_memory) == (True, 2, 3, 3)
    assert tried[:3] == [8, 8, 4]  # as it was, with checkpointing, then half, then half again
    again = compute_gradient(cm, x, y, microbatch_size=8)  # the device remembers what fits
    assert again.out_of_memory == 0


def test_a_model_without_checkpointing_goes_straight_to_smaller_microbatches(monkeypatch: pytest.MonkeyPatch) -> None:
    config = {"in_dim": 5, "hidden": [7], "classes": 3}
    cm = _model("mlp", config)
    _running_out_above(cm, monkeypatch, samples=3)
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))

    result = compute_gradient(cm, x, y, microbatch_size=8)

    assert (cm.checkpointing, cm.microbatch_cap, result.out_of_memory) == (False, 2, 2)


def test_a_device_that_cannot_hold_one_sample_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    cm = _model("mlp", {"in_dim": 5, "hidden": [7], "classes": 3})
    _running_out_above(cm, monkeypatch, samples=0)

    with pytest.raises(torch.OutOfMemoryError):
        compute_gradient(cm, torch.randn(4, 5), torch.randint(0, 3, (4,)), microbatch_size=4)
