"""Small learnable datasets the end-to-end tests train on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def write_projection_dataset(path: Path, rows: int, model: dict[str, Any]) -> None:
    """x ~ N(0, 1), label = argmax of a fixed random projection: learnable, deterministic."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, model["in_dim"])).astype(np.float32)
    y = (x @ rng.standard_normal((model["in_dim"], model["classes"]))).argmax(axis=1).astype(np.int64)
    np.savez(path, x=x, y=y)
