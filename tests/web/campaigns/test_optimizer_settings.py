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


@pytest.mark.parametrize(
    ("optimizer", "fields", "message"),
    [
        ({"name": "adam"}, {}, r"OptimizerSpec.name: expected one of \['adamw', 'sgd', 'lamb'\]"),
        ({"lr": 0.0}, {}, "optimizer.lr must be positive"),
        ({"name": "sgd", "momentum": 1.0}, {}, r"optimizer.momentum must be in \[0, 1\), got 1.0"),
        ({"beta1": -0.1}, {}, r"optimizer.beta1 must be in \[0, 1\)"),
        ({"beta2": 1.0}, {}, r"optimizer.beta2 must be in \[0, 1\)"),
        ({"eps": 0.0}, {}, "optimizer.eps must be positive"),
        ({"weight_decay": -1.0}, {}, "optimizer.weight_decay must be 0 or more"),
        ({"warmup_steps": -1}, {}, "optimizer.warmup_steps must be 0 or more"),
        ({"min_lr_ratio": 1.5}, {}, r"optimizer.min_lr_ratio must be in \[0, 1\]"),
        ({"schedule": "linear"}, {}, "OptimizerSpec.schedule: expected one of"),
        ({"schedule": "cosine"}, {}, "optimizer.total_steps: a cosine schedule needs total_steps"),
        ({"schedule": "cosine", "total_steps": 0}, {}, "optimizer.total_steps must be at least 1"),
        ({"warmup_steps": 20, "total_steps": 10}, {}, r"optimizer.warmup_steps \(20\) must be at most total_steps \(10"),
        ({"schedule": "cosine", "warmup_steps": 20}, {"max_steps": 5}, r"warmup_steps \(20\) must be at most .* \(5\)"),
        ({"name": "lamb"}, {"num_aggregators": 99}, "LAMB gives each aggregator whole parameter tensors"),
        ({"warmup_steps": "3"}, {}, "OptimizerSpec.warmup_steps: expected an integer"),
    ],
)
def test_it_refuses_a_bad_optimizer_setting(optimizer: dict[str, Any], fields: dict[str, Any], message: str) -> None:
    with pytest.raises(CampaignConfigError, match=message):
        _create(optimizer, **fields)

    assert not Campaign.objects.exists()


def test_a_cosine_schedule_ends_at_the_campaigns_max_steps() -> None:
    campaign = _create({"name": "lamb", "schedule": "cosine", "warmup_steps": 5}, max_steps=100)

    assert campaign.optimizer["total_steps"] == 100
    assert campaign.optimizer["name"] == "lamb" and campaign.optimizer["warmup_steps"] == 5


def test_an_explicit_total_steps_wins_over_max_steps() -> None:
    campaign = _create({"schedule": "cosine", "total_steps": 40}, max_steps=100)

    assert campaign.optimizer["total_steps"] == 40
