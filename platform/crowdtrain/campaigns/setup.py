"""Creating and validating campaigns (the organizer UI of a later issue builds on this)."""

from __future__ import annotations

from dataclasses import asdict, replace
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
    target_batch_size: int, microbatch_size: int, codec: str, max_steps: int | None = None, num_aggregators: int = 1,
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
    spec = validate_optimizer(
        optimizer, max_steps=max_steps, num_aggregators=num_aggregators, tensors=len(entry.param_shapes(config))
    )
    if codec not in CODECS:
        raise CampaignConfigError(f"unknown codec {codec!r}; choose one of {', '.join(CODECS)}")
    if microbatch_size < 1 or target_batch_size < microbatch_size:
        raise CampaignConfigError(
            f"target batch size ({target_batch_size}) must be at least the microbatch size ({microbatch_size}) >= 1"
        )
    return config, asdict(spec), entry.param_count(config)


def validate_optimizer(
    optimizer: dict[str, Any], *, max_steps: int | None = None, num_aggregators: int = 1, tensors: int | None = None
) -> OptimizerSpec:
    """Check an optimizer and its schedule; a cosine schedule without ``total_steps`` takes ``max_steps``.

    Args:
        optimizer: the ``OptimizerSpec`` fields as JSON.
        max_steps: the campaign's step limit, if any.
        num_aggregators: how many slices the parameters are cut into.
        tensors: how many parameter tensors the model has (LAMB cuts slices between tensors).

    Raises:
        CampaignConfigError: naming the first bad field, its value, and what is accepted.
    """
    try:
        spec = from_dict(OptimizerSpec, optimizer)
    except ValueError as exc:
        raise CampaignConfigError(f"optimizer: {exc}") from None
    if spec.lr <= 0:
        raise CampaignConfigError(f"optimizer.lr must be positive, got {spec.lr}")
    for name in ("beta1", "beta2", "momentum"):
        value = getattr(spec, name)
        if not 0.0 <= value < 1.0:
            raise CampaignConfigError(f"optimizer.{name} must be in [0, 1), got {value}")
    if spec.eps <= 0:
        raise CampaignConfigError(f"optimizer.eps must be positive, got {spec.eps}")
    if spec.weight_decay < 0:
        raise CampaignConfigError(f"optimizer.weight_decay must be 0 or more, got {spec.weight_decay}")
    if spec.warmup_steps < 0:
        raise CampaignConfigError(f"optimizer.warmup_steps must be 0 or more, got {spec.warmup_steps}")
    if not 0.0 <= spec.min_lr_ratio <= 1.0:
        raise CampaignConfigError(f"optimizer.min_lr_ratio must be in [0, 1], got {spec.min_lr_ratio}")
    total = spec.total_steps
    if total is None and spec.schedule == "cosine":
        if max_steps is None:
            raise CampaignConfigError(
                "optimizer.total_steps: a cosine schedule needs total_steps (or the campaign's max steps) "
                "to know where the decay ends"
            )
        total = max_steps
    if total is not None:
        if total < 1:
            raise CampaignConfigError(f"optimizer.total_steps must be at least 1, got {total}")
        if spec.warmup_steps > total:
            raise CampaignConfigError(
                f"optimizer.warmup_steps ({spec.warmup_steps}) must be at most total_steps ({total})"
            )
    if spec.name == "lamb" and tensors is not None and num_aggregators > tensors:
        raise CampaignConfigError(
            f"optimizer.name: LAMB gives each aggregator whole parameter tensors, but the model has {tensors} "
            f"tensors for {num_aggregators} aggregators; use fewer aggregators or another optimizer"
        )
    return replace(spec, total_steps=total)


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
        max_steps=fields.get("max_steps"), num_aggregators=fields.get("num_aggregators", 1),
    )
    return Campaign.objects.create(
        name=name, owner=owner, dataset=dataset, architecture=architecture, model_config=config, optimizer=opt,
        target_batch_size=target_batch_size, microbatch_size=microbatch_size, codec=codec, param_count=count, **fields,
    )
