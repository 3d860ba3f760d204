"""seed_run gives an npz dataset a validation split when its spec asks for one (the home-link bench compares losses)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from django.core.management import call_command

from crowdtrain.datasets.models import Dataset

pytestmark = pytest.mark.django_db


def _seed_npz(tmp_path: Path, **dataset: object) -> Dataset:
    npz = tmp_path / "rows.npz"
    with npz.open("wb") as fh:
        np.savez(fh, x=np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32), y=np.arange(64) % 4)
    spec = {"campaigns": [{
        "dataset": {"kind": "npz", "path": str(npz), "name": "rows", **dataset},
        "architecture": "mlp", "model_config": {"in_dim": 8, "hidden": [16], "classes": 4},
        "target_batch_size": 16, "microbatch_size": 8,
    }]}  # fmt: skip
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    call_command("seed_run", "--spec", str(path), stdout=io.StringIO())
    return Dataset.objects.get(name="rows")


def test_it_holds_out_the_last_rows_it_is_asked_for(tmp_path: Path) -> None:
    dataset = _seed_npz(tmp_path, validation_fraction=0.25)

    assert dataset.num_samples == 48
    assert sum(s.num_samples for s in dataset.validation_shards()) == 16


def test_without_a_fraction_every_row_trains(tmp_path: Path) -> None:
    dataset = _seed_npz(tmp_path)

    assert dataset.num_samples == 64
    assert not dataset.validation_shards().exists()
