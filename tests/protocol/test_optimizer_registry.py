"""The optimizer registry: one entry per optimizer, bounds checked the same way everywhere, unknown names refused."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crowdtrain_agent import optimizers
from crowdtrain_agent.fields import ConfigField
from crowdtrain_agent.optimizers import (
    HYPERPARAMETERS,
    LR,
    OPTIMIZERS,
    OptimizerConfigError,
    OptimizerEntry,
    get_optimizer,
    hyperparameters_of,
    register,
    to_wire,
    unregister,
    validate_config,
)  # fmt: skip
from crowdtrain_agent.protocol import OptimizerSpec
from crowdtrain_agent.protocol.schema import to_dict

RHO = ConfigField("float", 0.5, 0.0, 1.0, "a made-up decay", "rho")


@pytest.fixture
def novel() -> Iterator[OptimizerEntry]:
    entry = register(OptimizerEntry(
        name="novel", label="Novel", description="a test optimizer", hyperparameters={"lr": LR, "rho": RHO},
        builder="tests.backbone.test_a_registered_optimizer_trains:build_novel",
    ))  # fmt: skip
    yield entry
    unregister("novel")


def test_an_unknown_optimizer_is_an_error_that_lists_the_known_ones() -> None:
    with pytest.raises(OptimizerConfigError, match=r"unknown optimizer 'adam'; this version knows adamw \(") as e:
        get_optimizer("adam")

    assert e.value.field == "name"


def test_the_registry_defaults_are_the_wire_defaults() -> None:
    wire = to_dict(OptimizerSpec())

    for name, spec in HYPERPARAMETERS.items():
        if name in wire:
            assert spec.default == wire[name], name


def test_a_hyperparameter_name_keeps_one_meaning_across_optimizers() -> None:
    other_lr = ConfigField("float", 1.0, 0.0, 100.0, "a wider range", "Learning rate")

    with pytest.raises(ValueError, match="'lr' is declared with other bounds"):
        register(OptimizerEntry(name="wide", label="Wide", description="", hyperparameters={"lr": other_lr},
                                builder="x:y"))  # fmt: skip

    assert "wide" not in OPTIMIZERS


def test_unregistering_forgets_the_hyperparameters_only_it_declared(novel: OptimizerEntry) -> None:
    assert "rho" in HYPERPARAMETERS

    unregister("novel")

    assert "rho" not in HYPERPARAMETERS and "lr" in HYPERPARAMETERS
    register(novel)  # the fixture unregisters it again


def test_validation_fills_defaults_and_checks_the_chosen_optimizers_bounds(novel: OptimizerEntry) -> None:
    entry, hyper, schedule = validate_config({"name": "novel", "lr": 0.1})

    assert entry is novel and hyper == {"lr": 0.1, "rho": 0.5}
    assert schedule["schedule"] == "constant" and schedule["total_steps"] is None
    with pytest.raises(OptimizerConfigError, match=r"optimizer.rho must be between 0 and 1, got 2.0") as e:
        validate_config({"name": "novel", "rho": 2.0})
    assert e.value.field == "rho"


def test_a_value_the_protocol_cannot_carry_may_only_keep_its_default(
    novel: OptimizerEntry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(optimizers, "wire_fields", lambda: frozenset({"name", "lr"}))

    assert to_wire("novel", {"lr": 0.1, "rho": 0.5}) == {"name": "novel", "lr": 0.1}
    with pytest.raises(OptimizerConfigError, match="cannot send it to aggregators yet") as e:
        to_wire("novel", {"lr": 0.1, "rho": 0.7})
    assert e.value.field == "rho"


def test_a_protocol_with_extra_carries_every_hyperparameter(
    novel: OptimizerEntry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(optimizers, "wire_fields", lambda: frozenset({"name", "lr", "extra"}))

    wire = to_wire("novel", {"lr": 0.1, "rho": 0.7})

    assert wire == {"name": "novel", "lr": 0.1, "extra": {"rho": 0.7}}


def test_the_aggregator_reads_hyperparameters_from_their_fields() -> None:
    spec = OptimizerSpec(name="sgd", lr=0.2, momentum=0.5, nesterov=True, weight_decay=0.1)

    assert hyperparameters_of(spec) == {
        "lr": 0.2,
        "momentum": 0.5,
        "nesterov": True,
        "weight_decay": 0.1,
        "decay_all": False,
    }


def test_the_aggregator_refuses_an_unknown_optimizer_rather_than_running_sgd() -> None:
    with pytest.raises(OptimizerConfigError, match="unknown optimizer 'adagrad'"):
        hyperparameters_of(OptimizerSpec(name="adagrad"))  # type: ignore[arg-type]


def test_every_optimizer_is_per_element_or_says_it_needs_whole_tensors() -> None:
    assert {name for name, entry in OPTIMIZERS.items() if entry.per_tensor} == {"lamb"}


# ---------------------------------------------------------------------- bounds, as every caller checks them

bounds = st.tuples(st.floats(-10, 10), st.floats(0, 10), st.booleans(), st.booleans()).map(
    lambda t: ConfigField("float", None, t[0], t[0] + t[1], open_minimum=t[2], open_maximum=t[3])
)


@given(bounds, st.one_of(st.floats(-25, 25), st.sampled_from([-10.0, 0.0, 10.0]), st.just(math.inf)))
def test_a_float_is_accepted_exactly_when_it_lies_within_the_bounds(spec: ConfigField, value: float) -> None:
    above = value > spec.minimum if spec.open_minimum else value >= spec.minimum
    below = value < spec.maximum if spec.open_maximum else value <= spec.maximum

    try:
        spec.check(value, "x")
        accepted = True
    except ValueError as exc:
        accepted = False
        assert f"x must be {spec.bounds_text()}, got {value!r}" == str(exc)

    assert accepted == (math.isfinite(value) and above and below)


def test_bounds_read_as_words() -> None:
    assert LR.bounds_text() == "above 0 and at most 10"
    assert HYPERPARAMETERS["beta1"].bounds_text() == "at least 0 and below 1"
    assert HYPERPARAMETERS["weight_decay"].bounds_text() == "between 0 and 1"
    assert HYPERPARAMETERS["decay_all"].bounds_text() == "true or false"
