"""Creating and validating campaigns (the organizer UI of a later issue builds on this)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from django.db import models

from crowdtrain_agent.codec import CODECS
from crowdtrain_agent.models import ModelConfigError, get_model
from crowdtrain_agent.protocol import OptimizerSpec
from crowdtrain_agent.protocol.schema import from_dict

from .models import Campaign, Dataset


class CampaignConfigError(ValueError):
    """A campaign setting the platform cannot train with; the message names it."""


def validate_campaign(
    *, dataset: Dataset, architecture: str, model_config: dict[str, Any], optimizer: dict[str, Any],
    target_batch_size: int, microbatch_size: int, codec: str,
) -> tuple[dict[str, Any], dict[str, Any], int]:
    """Check a campaign's settings against the registry and its dataset.

    Returns:
        (normalized model config, normalized optimizer, parameter count).

    Raises:
        CampaignConfigError: naming the first bad setting.
    """
    try:
        entry = get_model(architecture)
        config = entry.validate(model_config)
    except ModelConfigError as exc:
        raise CampaignConfigError(str(exc)) from None
    if entry.data_kind != dataset.kind:
        raise CampaignConfigError(f"{architecture} trains on {entry.data_kind} data but {dataset} holds {dataset.kind}")
    if entry.data_kind == "text" and entry.sample_len(config) != dataset.sample_len:
        raise CampaignConfigError(
            f"{architecture}.block_size + 1 = {entry.sample_len(config)} must equal the dataset's sample length "
            f"{dataset.sample_len}"
        )
    try:
        spec = from_dict(OptimizerSpec, optimizer)
    except ValueError as exc:
        raise CampaignConfigError(f"optimizer: {exc}") from None
    if spec.lr <= 0:
        raise CampaignConfigError(f"optimizer.lr must be positive, got {spec.lr}")
    if codec not in CODECS:
        raise CampaignConfigError(f"unknown codec {codec!r}; choose one of {', '.join(CODECS)}")
    if microbatch_size < 1 or target_batch_size < microbatch_size:
        raise CampaignConfigError(
            f"target batch size ({target_batch_size}) must be at least the microbatch size ({microbatch_size}) >= 1"
        )
    return config, asdict(spec), entry.param_count(config)


def create_campaign(*, name: str, owner: models.Model, dataset: Dataset, architecture: str,
                    model_config: dict[str, Any], optimizer: dict[str, Any] | None = None,
                    target_batch_size: int = 256, microbatch_size: int = 16, codec: str = "fp32",
                    **fields: Any) -> Campaign:
    """Validate and save a draft campaign.

    Raises:
        CampaignConfigError: naming the bad setting; nothing is saved.
    """
    config, opt, count = validate_campaign(
        dataset=dataset, architecture=architecture, model_config=model_config, optimizer=optimizer or {},
        target_batch_size=target_batch_size, microbatch_size=microbatch_size, codec=codec,
    )
    return Campaign.objects.create(
        name=name, owner=owner, dataset=dataset, architecture=architecture, model_config=config, optimizer=opt,
        target_batch_size=target_batch_size, microbatch_size=microbatch_size, codec=codec, param_count=count, **fields,
    )
