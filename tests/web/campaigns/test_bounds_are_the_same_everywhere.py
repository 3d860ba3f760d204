"""The form, create_campaign (seed_run, the demo) and the admin accept the same values, with the same message."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from django.contrib.auth.models import AbstractBaseUser
from django.forms.models import model_to_dict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crowdtrain.campaigns.admin import CampaignAdminForm
from crowdtrain.campaigns.forms import CampaignForm
from crowdtrain.campaigns.models import Campaign
from crowdtrain.campaigns.settings_table import SETTINGS
from crowdtrain.campaigns.setup import CampaignConfigError, create_campaign
from crowdtrain.datasets.models import Dataset
from crowdtrain_agent.fields import ConfigField
from crowdtrain_agent.optimizers import HYPERPARAMETERS, OPTIMIZERS, SCHEDULE
from tests.factories import TINY_GPT, make_text_dataset

pytestmark = pytest.mark.django_db

BASE_OPTIMIZER = {"warmup_steps": 0, "schedule": "constant", "min_lr_ratio": 0.0}
BASE_SETTINGS = {
    "target_batch_size": 32, "microbatch_size": 4, "codec": "fp32", "max_steps": 20, "target_val_loss": 2.5,
    "validate_every": 10, "seed": 7, "num_aggregators": 1, "staleness": 1, "checkpoint_every": 10,
    "max_grad_norm": 1e4,
}  # fmt: skip


def _numeric(specs: dict[str, ConfigField]) -> dict[str, ConfigField]:
    return {name: spec for name, spec in specs.items() if spec.kind in ("int", "float")}


# (optimizer, field) pairs: each optimizer's own numeric hyperparameters, the schedule's, every setting's.
CASES = sorted(
    {(name, h) for name, entry in OPTIMIZERS.items() for h in _numeric(entry.hyperparameters)}
    | {("adamw", s) for s in _numeric(SCHEDULE) if s != "total_steps"}
    | {("adamw", s) for s in _numeric({n: s.spec for n, s in SETTINGS.items()})}
)


def _spec(field: str) -> ConfigField:
    if field in SETTINGS:
        return SETTINGS[field].spec
    return SCHEDULE.get(field) or HYPERPARAMETERS[field]


def values_around(spec: ConfigField) -> st.SearchStrategy[Any]:
    """Values at, just past and between the bounds: where a form and a validator would disagree."""
    low, high = spec.minimum, spec.maximum
    if spec.kind == "int":
        low, high = int(low), int(high)
        return st.one_of(st.integers(low - 2, low + 2), st.integers(high - 2, high + 2), st.integers(low, high))
    edges = [low, high, math.nextafter(low, -math.inf), math.nextafter(high, math.inf), (low + high) / 2]
    return st.one_of(st.sampled_from(edges), st.floats(low - 1, high + 1, allow_nan=False, allow_infinity=False))


cases = st.sampled_from(CASES).flatmap(lambda case: st.tuples(st.just(case), values_around(_spec(case[1]))))


@pytest.fixture
def dataset(olga: AbstractBaseUser) -> Dataset:
    dataset = make_text_dataset()
    Dataset.objects.filter(pk=dataset.pk).update(owner=olga)
    return Dataset.objects.get(pk=dataset.pk)


def via_create(dataset: Dataset, owner: Any, optimizer: dict[str, Any], fields: dict[str, Any]) -> str | None:
    try:
        create_campaign(name="c", owner=owner, dataset=dataset, architecture="gpt", model_config=TINY_GPT,
                        optimizer=optimizer, **fields)  # fmt: skip
    except CampaignConfigError as exc:
        return str(exc)
    return None


def via_form(dataset: Dataset, owner: Any, optimizer: dict[str, Any], fields: dict[str, Any]) -> str | None:
    data = {
        "name": "c", "visibility": "public", "dataset": dataset.pk, "architecture": "gpt",
        **{f"gpt__{k}": v for k, v in TINY_GPT.items()}, "mlp__in_dim": 4, "mlp__hidden": "8", "mlp__classes": 3,
        "optimizer": optimizer["name"], **{k: v for k, v in optimizer.items() if k != "name"},
        **{k: "" if v is None else v for k, v in fields.items()},
    }  # fmt: skip
    form = CampaignForm(data, user=owner)
    if form.is_valid():
        return None
    messages = [m for errors in form.errors.values() for m in errors]
    assert len(messages) == 1, form.errors
    return messages[0]


def via_admin(dataset: Dataset, owner: Any, optimizer: dict[str, Any], fields: dict[str, Any]) -> str | None:
    base = create_campaign(name="base", owner=owner, dataset=dataset, architecture="gpt", model_config=TINY_GPT,
                           optimizer=BASE_OPTIMIZER, **BASE_SETTINGS)  # fmt: skip
    data = {**model_to_dict(base), **fields, "optimizer": json.dumps(optimizer),
            "model_config": json.dumps(base.model_config)}  # fmt: skip
    data = {k: "" if v is None else v for k, v in data.items()}
    form = CampaignAdminForm(data, instance=base)
    valid = form.is_valid()
    base.delete()
    if valid:
        return None
    messages = [m for errors in form.errors.values() for m in errors]
    assert len(messages) == 1, form.errors
    return messages[0]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cases)
def test_a_value_is_refused_by_all_or_by_none_with_one_message(
    dataset: Dataset, olga: AbstractBaseUser, case: tuple[tuple[str, str], Any]
) -> None:
    (name, field), value = case
    optimizer: dict[str, Any] = {"name": name, **BASE_OPTIMIZER}
    fields = dict(BASE_SETTINGS)
    if field in SETTINGS:
        fields[field] = value
    else:
        optimizer[field] = value

    by_create = via_create(dataset, olga, optimizer, fields)
    by_form = via_form(dataset, olga, optimizer, fields)
    by_admin = via_admin(dataset, olga, optimizer, fields)

    assert by_form == by_create == by_admin
    spec = _spec(field)
    try:
        spec.check(value, "x")
    except ValueError:
        assert by_create is not None, f"{field}={value!r} is out of bounds but was accepted"


def test_create_campaign_refuses_the_learning_rate_the_form_refuses(dataset: Dataset, olga: AbstractBaseUser) -> None:
    optimizer = {"name": "adamw", "lr": 100.0}

    by_create = via_create(dataset, olga, optimizer, BASE_SETTINGS)
    by_form = via_form(dataset, olga, optimizer, BASE_SETTINGS)

    assert by_create == by_form == "Learning rate (optimizer.lr) must be above 0 and at most 10, got 100.0"
    assert not Campaign.objects.exists()
