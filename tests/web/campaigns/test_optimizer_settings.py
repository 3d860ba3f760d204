"""Bad optimizer and schedule settings are refused with a message naming the field; nothing is saved."""

from __future__ import annotations

from typing import Any

import pytest

from crowdtrain.campaigns.models import Campaign
from crowdtrain.campaigns.setup import CampaignConfigError, create_campaign
from tests.factories import TINY_GPT, make_text_dataset, make_user

pytestmark = pytest.mark.django_db


def _create(optimizer: dict[str, Any], **fields: Any) -> Campaign:
    return create_campaign(
        name="c", owner=make_user("organizer"), dataset=make_text_dataset(), architecture="gpt",
        model_config=TINY_GPT, optimizer=optimizer, target_batch_size=32, microbatch_size=4, **fields,
    )  # fmt: skip


BAD_OPTIMIZERS = [
    ({"name": "adam"}, {}, "optimizer", "unknown optimizer 'adam'; this version knows adamw \\(AdamW\\), lamb"),
    ({"name": None}, {}, "optimizer", "unknown optimizer None"),
    ({"lr": 0.0}, {}, "lr", r"Learning rate \(optimizer.lr\) must be above 0 and at most 10, got 0.0"),
    ({"lr": 100.0}, {}, "lr", r"Learning rate \(optimizer.lr\) must be above 0 and at most 10, got 100.0"),
    ({"name": "sgd", "momentum": 1.0}, {}, "momentum", r"\(optimizer.momentum\) must be at least 0 and below 1"),
    ({"beta1": -0.1}, {}, "beta1", r"optimizer.beta1 must be at least 0 and below 1, got -0.1"),
    ({"beta2": 1.0}, {}, "beta2", r"optimizer.beta2 must be at least 0 and below 1, got 1.0"),
    ({"name": "sgd", "beta2": 1.0}, {}, "beta2", r"optimizer.beta2 must be at least 0 and below 1"),
    ({"eps": 0.0}, {}, "eps", "optimizer.eps must be above 0"),
    ({"weight_decay": -1.0}, {}, "weight_decay", r"Weight decay \(optimizer.weight_decay\) must be between 0 and 1"),
    ({"warmup_steps": -1}, {}, "warmup_steps", r"Warmup steps \(optimizer.warmup_steps\) must be between 0 and"),
    ({"min_lr_ratio": 1.5}, {}, "min_lr_ratio", r"Minimum LR ratio \(optimizer.min_lr_ratio\) must be between 0 and 1"),
    ({"schedule": "linear"}, {}, "schedule", r"Schedule \(optimizer.schedule\) must be one of constant, cosine"),
    ({"schedule": "cosine"}, {}, "schedule", "optimizer.total_steps: a cosine schedule decays until total_steps"),
    ({"schedule": "cosine", "total_steps": 0}, {}, "total_steps", r"\(optimizer.total_steps\) must be between 1"),
    ({"warmup_steps": 20, "total_steps": 10}, {}, "warmup_steps", r"is 20, but must be at most total_steps \(10\)"),
    (
        {"schedule": "cosine", "warmup_steps": 20},
        {"max_steps": 5},
        "warmup_steps",
        r"is 20, but must be fewer than max steps \(5\)",
    ),
    ({"name": "lamb"}, {"num_aggregators": 60}, "num_aggregators", "LAMB gives each aggregator whole parameter"),
    ({"warmup_steps": "3"}, {}, "warmup_steps", r"Warmup steps \(optimizer.warmup_steps\) must be an integer, got '3'"),
    ({"rho": 0.5}, {}, "optimizer", "optimizer: unknown field 'rho'; AdamW takes lr, beta1"),
    ({"decay_all": "yes"}, {}, "decay_all", r"Decay every tensor \(optimizer.decay_all\) must be true or false"),
]


@pytest.mark.parametrize(("optimizer", "fields", "field", "message"), BAD_OPTIMIZERS,
                         ids=[f"{f}-{m[:24]}" for _, _, f, m in BAD_OPTIMIZERS])  # fmt: skip
def test_it_refuses_a_bad_optimizer_setting_naming_the_field(
    optimizer: dict[str, Any], fields: dict[str, Any], field: str, message: str
) -> None:
    with pytest.raises(CampaignConfigError, match=message) as caught:
        _create(optimizer, **fields)

    assert caught.value.field == field
    assert not Campaign.objects.exists()


def test_a_cosine_schedule_ends_at_the_campaigns_max_steps() -> None:
    campaign = _create({"name": "lamb", "schedule": "cosine", "warmup_steps": 5}, max_steps=100)

    assert campaign.optimizer["total_steps"] == 100
    assert campaign.optimizer["name"] == "lamb" and campaign.optimizer["warmup_steps"] == 5


def test_an_explicit_total_steps_wins_over_max_steps() -> None:
    campaign = _create({"schedule": "cosine", "total_steps": 40}, max_steps=100)

    assert campaign.optimizer["total_steps"] == 40
