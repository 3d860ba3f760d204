"""An organizer's Llama on a text upload becomes a campaign; a model over the site's size limit is refused with
what was counted."""

from __future__ import annotations

from typing import Any

import pytest

from crowdtrain.campaigns.setup import CampaignConfigError, validate_campaign
from tests.factories import make_text_dataset

pytestmark = pytest.mark.django_db

LLAMA = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "block_size": 8}  # fmt: skip
# Embeddings in and out (untied, 256 byte ids); per layer q and o (32 x 32), k and v (32 x 2 heads of 8), the
# SwiGLU's three matrices (32 x 64) and two RMSNorms; the final norm.
LLAMA_PARAMS = 2 * 256 * 32 + 2 * (32 * 32 * 2 + 32 * 16 * 2 + 3 * 32 * 64 + 2 * 32) + 32


def _validate(**changes: Any) -> tuple[dict[str, Any], dict[str, Any], int]:
    options: dict[str, Any] = {"dataset": make_text_dataset(sample_len=9), "architecture": "llama",
                               "model_config": LLAMA, "optimizer": {"name": "adamw", "lr": 1e-3},
                               "target_batch_size": 8, "microbatch_size": 4, "codec": "fp32"}  # fmt: skip
    return validate_campaign({**options, **changes})


def test_a_llama_on_bytes_is_a_campaign_with_its_parameters_counted() -> None:
    config, _, count = _validate()

    assert config["vocab_size"] == 256 and config["tie_word_embeddings"] is False
    assert count == LLAMA_PARAMS


def test_a_model_over_the_sites_limit_is_refused_with_the_count(settings: Any) -> None:
    settings.CROWDTRAIN_MAX_MODEL_PARAMS = 10_000

    with pytest.raises(CampaignConfigError) as refused:
        _validate()

    assert f"llama with this config has {LLAMA_PARAMS:,} parameters (counted from the config)" in str(refused.value)
    assert "CROWDTRAIN_MAX_MODEL_PARAMS" in str(refused.value) and refused.value.field == "architecture"


def test_an_image_model_needs_an_image_dataset() -> None:
    with pytest.raises(CampaignConfigError, match="vit trains on tensors data but"):
        _validate(architecture="vit", model_config={})
