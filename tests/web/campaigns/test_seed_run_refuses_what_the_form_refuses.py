"""seed_run creates campaigns through create_campaign: a value the form refuses stops it with the same message."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from crowdtrain.campaigns.models import Campaign
from tests.factories import TINY_GPT

pytestmark = pytest.mark.django_db


def _seed(tmp_path: Path, **campaign: Any) -> None:
    spec = {"campaigns": [{
        "dataset": {"kind": "stdlib", "bytes": 4096, "sample_len": TINY_GPT["block_size"] + 1},
        "architecture": "gpt", "model_config": TINY_GPT, "target_batch_size": 8, "microbatch_size": 4, **campaign,
    }]}  # fmt: skip
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    call_command("seed_run", "--spec", str(path), stdout=io.StringIO())


@pytest.mark.parametrize(
    ("campaign", "message"),
    [
        ({"optimizer": {"name": "adamw", "lr": 100}}, r"Learning rate \(optimizer.lr\) must be above 0 and at most 10"),
        ({"optimizer": {"name": "adagrad"}}, "unknown optimizer 'adagrad'; this version knows adamw"),
        ({"checkpoint_every": 0}, r"Checkpoint every \(checkpoint_every\) must be between 1 and"),
        ({"max_grad_norm": -1}, r"Max gradient norm \(max_grad_norm\) must be between 0 and"),
    ],
)
def test_a_spec_out_of_bounds_creates_nothing(tmp_path: Path, campaign: dict[str, Any], message: str) -> None:
    with pytest.raises(CommandError, match=message):
        _seed(tmp_path, **campaign)

    assert not Campaign.objects.exists()


def test_a_spec_within_bounds_runs(tmp_path: Path) -> None:
    _seed(tmp_path, optimizer={"name": "sgd", "lr": 0.5, "momentum": 0.9, "weight_decay": 0.01}, max_steps=10)

    campaign = Campaign.objects.get()
    assert campaign.state == Campaign.State.RUNNING and campaign.optimizer["momentum"] == 0.9
