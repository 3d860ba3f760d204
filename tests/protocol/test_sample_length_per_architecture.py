"""Each text architecture says how long its samples are; nothing assumes GPT's block_size."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from crowdtrain_agent.models import REGISTRY, ModelEntry, get_model, max_text_sample_len
from crowdtrain_agent.models.registry import ConfigField


def _windowed_text_model(max_window: int = 20000) -> ModelEntry:
    """A text architecture whose context field is not called block_size, and whose samples are the window itself."""
    return ModelEntry(
        name="windowed", description="a text model with a window", data_kind="text",
        fields={"window": ConfigField("int", 32, 2, max_window)},
        _build=lambda c: nn.Embedding(256, 4), _flops_forward=lambda c: c["window"],
        _loss_sum=lambda model, x, y: torch.zeros(()), _sample_len=lambda c: c["window"], max_sample_len=max_window,
    )  # fmt: skip


def test_a_gpt_sample_is_its_context_plus_the_shifted_target() -> None:
    assert get_model("gpt").sample_len({"block_size": 16}) == 17


def test_a_model_trained_on_tensors_has_no_sample_length() -> None:
    assert get_model("mlp").sample_len({}) == 0


def test_a_text_model_without_block_size_answers_from_its_own_field() -> None:
    entry = _windowed_text_model()

    assert entry.sample_len({"window": 100}) == 100


def test_the_longest_text_sample_is_the_registrys_longest_gpt_context_plus_one() -> None:
    assert max_text_sample_len() == REGISTRY["gpt"].fields["block_size"].maximum + 1


def test_a_new_text_architecture_raises_the_longest_text_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(REGISTRY, "windowed", _windowed_text_model(max_window=20000))

    assert max_text_sample_len() == 20000


def test_a_text_architecture_must_say_how_long_its_samples_are() -> None:
    fields: dict[str, Any] = {"window": ConfigField("int", 32)}

    with pytest.raises(TypeError, match="needs _sample_len"):
        ModelEntry(
            name="vague", description="", data_kind="text", fields=fields, _build=lambda c: nn.Identity(),
            _flops_forward=lambda c: 1, _loss_sum=lambda model, x, y: torch.zeros(()),
        )  # fmt: skip
