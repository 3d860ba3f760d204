"""A Llama-family model built by transformers trains through the real programs (daphne, an aggregator, two
agents) on the standard library's source as bytes, and the parameters equal plain PyTorch replaying the
committed steps on the same model: the library's model is the registry's, on every device."""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e.replay import trains_like_plain_pytorch
from tests.e2e.test_two_aggregators_match_plain_pytorch import SITE_ENV

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(200)]

STEPS = 4
SPEC = {
    "campaigns": [{
        "name": "tiny Llama", "architecture": "llama",
        "model_config": {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "block_size": 32},
        "dataset": {"kind": "stdlib", "bytes": 256 << 10, "sample_len": 33, "shard_bytes": 64 << 10},
        "optimizer": {"name": "adamw", "lr": 1e-2}, "target_batch_size": 64, "microbatch_size": 16,
        "staleness": 0, "max_steps": STEPS, "seed": 7, "codec": "fp32", "num_aggregators": 2,
        "check_fraction": 0.0,
    }],
    "aggregators": ["agg-1", "agg-2"],
    "agents": ["agent-1", "agent-2"],
}  # fmt: skip


def test_a_llama_trains_and_matches_a_plain_pytorch_replay(seeded_run: Any) -> None:
    _, losses, _ = trains_like_plain_pytorch(seeded_run(SPEC, SITE_ENV), STEPS)

    assert losses[-1] < losses[0], f"loss did not fall: {losses}"
