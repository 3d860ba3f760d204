"""Exported models: flat parameters become named safetensors tensors that load_exported turns back into the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from crowdtrain_agent.models import ModelConfigError, export_bytes, get_model, load_exported, model_from_flat

GPT = {"n_layer": 1, "n_head": 2, "n_embd": 8, "block_size": 8}
MLP = {"in_dim": 4, "hidden": [8], "classes": 3}


def _write(tmp_path: Path, model: torch.nn.Module, config: dict) -> tuple[Path, Path]:
    weights, meta = tmp_path / "model.safetensors", tmp_path / "config.json"
    weights.write_bytes(export_bytes(model))
    meta.write_text(json.dumps(config))
    return weights, meta


@pytest.mark.parametrize(("architecture", "config"), [("gpt", GPT), ("mlp", MLP)])
def test_a_flat_vector_round_trips_through_an_export(tmp_path: Path, architecture: str, config: dict) -> None:
    flat = torch.randn(get_model(architecture).param_count(config), generator=torch.Generator().manual_seed(5))
    weights, meta = _write(tmp_path, model_from_flat(architecture, config, flat), {"architecture": architecture,
                                                                                   "model_config": config})  # fmt: skip

    model = load_exported(weights, meta)

    assert torch.equal(torch.nn.utils.parameters_to_vector(model.parameters()), flat)
    assert not model.training


def test_param_shapes_lay_out_the_flat_vector_in_parameter_order() -> None:
    model = get_model("mlp").build(MLP, seed=0)

    shapes = get_model("mlp").param_shapes(MLP)

    assert shapes == [tuple(p.shape) for p in model.parameters()] == [(8, 4), (8,), (3, 8), (3,)]


def test_a_vector_of_the_wrong_size_is_refused() -> None:
    with pytest.raises(ModelConfigError, match="mlp with this config has 67 parameters but the vector holds 66"):
        model_from_flat("mlp", MLP, torch.zeros(66))


def test_a_config_without_the_architecture_is_refused(tmp_path: Path) -> None:
    weights, meta = _write(tmp_path, get_model("mlp").build(MLP), {"model_config": MLP})

    with pytest.raises(ModelConfigError, match="exported config has no 'architecture'"):
        load_exported(weights, meta)


def test_weights_of_another_model_config_are_refused(tmp_path: Path) -> None:
    weights, _ = _write(tmp_path, get_model("mlp").build(MLP), {})

    with pytest.raises(ModelConfigError, match="does not fit mlp"):
        load_exported(weights, {"architecture": "mlp", "model_config": {**MLP, "classes": 4}})
