"""A new optimizer is a registry entry plus its builder: the aggregator finds it by name, and only by name."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch

from crowdtrain_agent.optimizers import LR, OPTIMIZERS, OptimizerConfigError, OptimizerEntry, register, unregister
from crowdtrain_agent.protocol import OptimizerSpec
from crowdtrain_backbone.optimizers import SliceLayout, builder_of
from crowdtrain_backbone.slices import MemoryBudget, PendingUpload, SliceState, initial_params

from .conftest import assignment


def build_novel(param: torch.nn.Parameter, hyper: Mapping[str, Any], layout: SliceLayout) -> torch.optim.Optimizer:
    """Plain SGD: the builder a registry entry names (this module is file 2 of 2)."""
    return torch.optim.SGD([param], lr=hyper["lr"])


@pytest.fixture
def novel() -> Iterator[OptimizerEntry]:
    entry = register(OptimizerEntry(
        name="novel", label="Novel", description="plain SGD under another name", hyperparameters={"lr": LR},
        builder=f"{__name__}:build_novel",
    ))  # fmt: skip
    yield entry
    unregister("novel")


def _state(spec: OptimizerSpec) -> SliceState:
    order = assignment(bounds=(0, 3), optimizer=spec)
    return SliceState(order, initial_params(order), 0, MemoryBudget(1 << 20))


def test_every_registered_optimizer_has_a_builder_on_the_aggregator() -> None:
    for entry in OPTIMIZERS.values():
        assert callable(builder_of(entry)), entry.name


@pytest.mark.usefixtures("novel")
def test_the_aggregator_builds_and_steps_a_newly_registered_optimizer() -> None:
    # The wire type still lists the three shipped names; a dataclass does not check them when built.
    state = _state(OptimizerSpec(name="novel", lr=0.5))  # type: ignore[arg-type]
    before = state.param.detach().clone()

    state.add_pending(PendingUpload(1, 0, 2, torch.tensor([2.0, 4.0, 6.0])))
    state.finish_step(state.apply_step_(state.collect([1], 2), 2), [1])

    torch.testing.assert_close(state.param.detach(), before - 0.5 * torch.tensor([1.0, 2.0, 3.0]))


def test_an_unknown_optimizer_is_refused_never_run_as_sgd() -> None:
    with pytest.raises(OptimizerConfigError, match="unknown optimizer 'adagrad'; this version knows adamw"):
        _state(OptimizerSpec(name="adagrad"))  # type: ignore[arg-type]


def test_a_builder_this_aggregator_lacks_says_to_upgrade() -> None:
    entry = OptimizerEntry(name="later", label="Later", description="", hyperparameters={},
                           builder="crowdtrain_backbone.optimizers:build_later")  # fmt: skip

    with pytest.raises(ValueError, match="no builder 'crowdtrain_backbone.optimizers:build_later'; upgrade"):
        builder_of(entry)
