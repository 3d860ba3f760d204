"""A campaign starts from a transformers folder's weights: through the real programs (daphne, two aggregators
that fetch the weights from the site, two agents), its parameters equal plain PyTorch taking the committed
steps from those same weights. Started from the seeded init instead, they would be another model entirely."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from crowdtrain_agent.models.hf import library
from tests.e2e.replay import relative_error, trains_like_plain_pytorch
from tests.e2e.test_two_aggregators_match_plain_pytorch import SITE_ENV, rerun_in_pytorch

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(200)]

STEPS = 3


def _folder(tmp_path: Path) -> tuple[Path, torch.Tensor]:
    """A small pretrained Llama as an organizer would zip it, and its parameters in flat order."""
    torch.manual_seed(11)
    config = library("LlamaConfig")(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                    rms_norm_eps=1e-5, rope_theta=50000.0)  # fmt: skip
    model = library("LlamaForCausalLM")(config)
    with torch.no_grad():  # weights unlike any seeded init: "pretrained"
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "llama")
    archive = tmp_path / "llama.zip"
    with zipfile.ZipFile(archive, "w") as out:
        for path in (tmp_path / "llama").iterdir():
            out.write(path, f"llama/{path.name}")
    return archive, torch.nn.utils.parameters_to_vector(model.parameters()).detach()


def test_the_swarm_fine_tunes_the_uploaded_weights_like_plain_pytorch(seeded_run: Any, tmp_path: Path) -> None:
    archive, weights = _folder(tmp_path)
    spec = {
        "campaigns": [{
            "name": "fine-tuned Llama", "pretrained": {"path": str(archive)},
            "model_config": {"block_size": 32},  # shorter than the weights' 512 positions: RoPE has no table
            "dataset": {"kind": "stdlib", "bytes": 128 << 10, "sample_len": 33, "shard_bytes": 32 << 10},
            "optimizer": {"name": "adamw", "lr": 1e-3}, "target_batch_size": 32, "microbatch_size": 8,
            "staleness": 0, "max_steps": STEPS, "seed": 7, "codec": "fp32", "num_aggregators": 2,
            "check_fraction": 0.0,
        }],
        "aggregators": ["agg-1", "agg-2"],
        "agents": ["agent-1", "agent-2"],
    }  # fmt: skip

    dump, _, platform = trains_like_plain_pytorch(seeded_run(spec, SITE_ENV), STEPS, initial=weights)

    assert dump["model_config"]["rope_theta"] == 50000.0 and dump["model_config"]["block_size"] == 32
    seeded, _ = rerun_in_pytorch(dump, STEPS)
    assert relative_error(platform, seeded) > 0.1  # from the uploaded weights, not the seeded init
