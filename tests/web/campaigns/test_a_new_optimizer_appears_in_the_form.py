"""An optimizer registered in the registry shows up in the campaign form with its fields, and nothing else changes."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest
from django.test import Client

from crowdtrain_agent.fields import ConfigField
from crowdtrain_agent.optimizers import LR, OptimizerEntry, register, unregister, wire_fields
from tests.factories import make_organizer

pytestmark = pytest.mark.django_db

RHO = ConfigField("float", 0.5, 0.0, 1.0, "how fast the running average forgets", "Rho")


@pytest.fixture
def novel() -> Iterator[OptimizerEntry]:
    entry = register(OptimizerEntry(
        name="novel", label="Novel optimizer", description="for this test", hyperparameters={"lr": LR, "rho": RHO},
        builder="tests.backbone.test_a_registered_optimizer_trains:build_novel",
    ))  # fmt: skip
    yield entry
    unregister("novel")


@pytest.fixture
def page(client: Client, novel: OptimizerEntry) -> str:
    client.force_login(make_organizer("olga"))
    return client.get("/campaigns/new").content.decode()


def test_the_new_optimizer_is_a_choice_with_its_label(page: str) -> None:
    assert '<option value="novel">Novel optimizer</option>' in page


def test_its_new_hyperparameter_gets_a_field_with_label_help_and_bounds(page: str) -> None:
    field = re.search(r'<div class="field[^"]*" data-field="rho".*?</div>', page, re.DOTALL)

    assert field is not None
    assert "Rho" in field.group(0) and "how fast the running average forgets (between 0 and 1)" in field.group(0)
    assert 'min="0"' in field.group(0) and 'max="1"' in field.group(0)
    if "extra" not in wire_fields():  # until the protocol carries extra hyperparameters, it keeps its default
        assert "disabled" in field.group(0) and "newer protocol" in field.group(0)


def test_the_page_shows_only_the_chosen_optimizers_fields(page: str) -> None:
    shown = json.loads(re.search(r'<script id="optimizer-fields" type="application/json">(.*?)</script>', page,
                                 re.DOTALL).group(1))  # type: ignore[union-attr]  # fmt: skip

    assert shown["novel"] == ["lr", "rho"]
    assert shown["sgd"] == ["lr", "momentum", "nesterov", "weight_decay", "decay_all"]


def test_without_it_the_form_has_no_trace_of_it(client: Client) -> None:
    client.force_login(make_organizer("olga"))

    page = client.get("/campaigns/new").content.decode()

    assert 'value="novel"' not in page and 'data-field="rho"' not in page
