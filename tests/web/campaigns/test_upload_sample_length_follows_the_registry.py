"""An upload's sample length is capped by the registry's longest text sample, not by a copy of GPT's limit."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch import nn

from crowdtrain_agent.models import REGISTRY, ModelEntry, max_text_sample_len
from crowdtrain_agent.models.registry import ConfigField
from tests.factories import logged_in, make_organizer

pytestmark = pytest.mark.django_db


def _start(sample_len: int) -> Any:
    client = logged_in(make_organizer("olga"))
    body = {"filename": "corpus.txt", "size": 100_000, "format": "text", "sample_len": sample_len}
    return client.post("/datasets/uploads", json.dumps(body), content_type="application/json")


def test_one_byte_past_the_longest_text_sample_is_refused_naming_the_limit() -> None:
    longest = max_text_sample_len()

    response = _start(longest + 1)

    assert response.status_code == 400
    assert f"sample_len must be between 2 and {longest} bytes" in response.json()["error"]


def test_the_longest_text_sample_is_accepted() -> None:
    response = _start(max_text_sample_len())

    assert response.status_code == 201


def test_a_text_architecture_with_longer_samples_raises_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    longer = max_text_sample_len() + 1000
    monkeypatch.setitem(REGISTRY, "windowed", ModelEntry(
        name="windowed", description="a text model with a long window", data_kind="text",
        fields={"window": ConfigField("int", 32, 2, longer)}, _build=lambda c: nn.Embedding(256, 4),
        _flops_forward=lambda c: 1, _loss_sum=lambda model, x, y: torch.zeros(()),
        _sample_len=lambda c: c["window"], max_sample_len=longer,
    ))  # fmt: skip

    response = _start(longer)

    assert response.status_code == 201


def test_the_upload_page_offers_the_registrys_limit() -> None:
    client = logged_in(make_organizer("olga"))

    response = client.get("/datasets/new")

    assert f'max="{max_text_sample_len()}"' in response.content.decode()
