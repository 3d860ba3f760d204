from __future__ import annotations

import pytest
import torch

from crowdtrain_agent.models import ModelConfigError, get_model


@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_param_count_matches_the_built_model(name: str) -> None:
    entry = get_model(name)

    model = entry.build({}, seed=0)

    assert entry.param_count({}) == sum(p.numel() for p in model.parameters())


def test_the_same_seed_gives_the_same_weights_on_every_machine() -> None:
    entry = get_model("gpt")

    a = torch.nn.utils.parameters_to_vector(entry.build({"n_layer": 1}, seed=5).parameters())
    b = torch.nn.utils.parameters_to_vector(entry.build({"n_layer": 1}, seed=5).parameters())
    c = torch.nn.utils.parameters_to_vector(entry.build({"n_layer": 1}, seed=6).parameters())

    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_the_untrained_gpt_predicts_bytes_uniformly() -> None:
    entry = get_model("gpt")
    model = entry.build({"n_layer": 1, "block_size": 16}, seed=0)
    x, y = torch.randint(0, 256, (2, 8, 16), generator=torch.Generator().manual_seed(0))

    loss = entry.loss_sum(model, x, y) / 8

    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.1


@pytest.mark.parametrize(
    ("name", "config", "problem"),
    [
        ("gpt", {"n_embd": 130, "n_head": 4}, "must be divisible by gpt.n_head"),
        ("gpt", {"n_layer": 0}, "gpt.n_layer must be between 1"),
        ("gpt", {"n_layer": 2.5}, "gpt.n_layer must be an integer"),
        ("gpt", {"layers": 2}, "unknown field 'layers'"),
        ("mlp", {"hidden": []}, "non-empty list of integers"),
        ("mlp", {"classes": "ten"}, "mlp.classes must be an integer"),
    ],
)
def test_it_names_the_bad_field(name: str, config: dict, problem: str) -> None:
    with pytest.raises(ModelConfigError, match=problem):
        get_model(name).validate(config)


def test_an_unknown_architecture_says_what_this_agent_knows() -> None:
    with pytest.raises(ModelConfigError, match="this agent knows gpt, gpt2, llama, mlp, resnet, vit"):
        get_model("alexnet")


def test_flops_grow_with_the_model() -> None:
    entry = get_model("gpt")

    assert entry.flops_per_sample({"n_layer": 8}) > entry.flops_per_sample({"n_layer": 4}) > 0
