"""Datasets made the way uploads make them train through the real programs as plain PyTorch would:

- text tokenized by a BPE trained on it: the agent fetches the tokenizer beside the shards from the site,
  checks it, and trains a Llama of that vocabulary on the ids;
- images decoded from an archive of class folders, with flips and shifted crops: every device seeds each
  image's augmentation by its sample and version, so a replay that does the same lands on the same weights.
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from tests.e2e.replay import trains_like_plain_pytorch
from tests.e2e.test_two_aggregators_match_plain_pytorch import SITE_ENV

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(200)]

STEPS = 2
COMMON = {"staleness": 0, "max_steps": STEPS, "seed": 3, "codec": "fp32", "num_aggregators": 2,
          "check_fraction": 0.0, "optimizer": {"name": "adamw", "lr": 3e-3}}  # fmt: skip


def _matches_a_replay(run: Any) -> dict[str, Any]:
    return trains_like_plain_pytorch(run, STEPS)[0]


def test_a_llama_trains_on_text_tokenized_by_a_bpe_trained_on_it(seeded_run: Any) -> None:
    spec = {
        "campaigns": [{
            "name": "tokens", "architecture": "llama", **COMMON,
            "model_config": {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64,
                             "num_attention_heads": 4, "num_key_value_heads": 2, "block_size": 32, "vocab_size": 400},
            "dataset": {"kind": "stdlib", "bytes": 96 << 10, "sample_len": 33, "tokenizer": "train",
                        "vocab_size": 400, "shard_bytes": 8 << 10},
            "target_batch_size": 32, "microbatch_size": 8,
        }],
        "aggregators": ["agg-1", "agg-2"],
        "agents": ["agent-1"],
    }  # fmt: skip

    dump = _matches_a_replay(seeded_run(spec, SITE_ENV))

    data = dump["dataset"]["spec"]
    assert (data["kind"], data["vocab_size"], data["token_bytes"]) == ("tokens", 400, 2) and data["tokenizer"]


def _class_folders(path: Path) -> Path:
    rng = np.random.default_rng(0)
    with zipfile.ZipFile(path, "w") as archive:
        for label, colour in enumerate([(200, 40, 40), (40, 200, 40), (40, 40, 200)]):
            for i in range(16):
                pixels = np.clip(rng.normal(colour, 40, (20, 20, 3)), 0, 255).astype(np.uint8)
                out = io.BytesIO()
                Image.fromarray(pixels).save(out, format="PNG")
                archive.writestr(f"photos/class-{label}/{i}.png", out.getvalue())
    return path


def test_a_resnet_trains_on_augmented_images_from_class_folders(seeded_run: Any, tmp_path: Path) -> None:
    archive = _class_folders(tmp_path / "photos.zip")
    spec = {
        "campaigns": [{
            "name": "images", "architecture": "resnet", **COMMON, "augmentation": "flip_crop",
            "model_config": {"embedding_size": 8, "hidden_sizes": [8, 16], "depths": [1, 1], "image_size": 16,
                             "num_labels": 3},
            "dataset": {"kind": "images", "path": str(archive), "image_size": 16, "shard_bytes": 8 << 10},
            "target_batch_size": 16, "microbatch_size": 8,
        }],
        "aggregators": ["agg-1", "agg-2"],
        "agents": ["agent-1"],
    }  # fmt: skip

    dump = _matches_a_replay(seeded_run(spec, SITE_ENV))

    assert dump["dataset"]["spec"]["augment"] == "flip_crop"
