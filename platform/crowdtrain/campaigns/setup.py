"""Creating and validating campaigns: one set of checks for the form, create_campaign, seed_run and the admin."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from crowdtrain_agent.codec import CODECS
from crowdtrain_agent.models import ModelConfigError, get_model
from crowdtrain_agent.optimizers import OptimizerConfigError, setting_name, to_wire, validate_config
from crowdtrain_agent.protocol import OptimizerSpec, ProtocolError
from crowdtrain_agent.protocol.schema import from_dict, to_dict

from .models import Campaign, Dataset
from .settings_table import check_settings

if TYPE_CHECKING:
    from django.contrib.auth.models import User


class CampaignConfigError(ValueError):
    """A campaign setting the platform cannot train with; the message names it.

    ``field`` is the name the campaign form knows the setting by (``"lr"``,
    ``"dataset"``, ``"gpt__n_layer"``...), so the form shows the message next
    to it; None when no single field is at fault.
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def config_field_name(architecture: str, field: str) -> str:
    """The form's name for one model config field."""
    return f"{architecture}__{field}"


def validate_campaign(
    *,
    dataset: Dataset,
    architecture: str,
    model_config: dict[str, Any],
    optimizer: dict[str, Any],
    target_batch_size: int,
    microbatch_size: int,
    codec: str,
    max_steps: int | None = None,
    num_aggregators: int = 1,
) -> tuple[dict[str, Any], dict[str, Any], int]:
    """Check a campaign's settings against the registries and its dataset.

    Returns:
        (normalized model config, normalized optimizer, parameter count).

    Raises:
        CampaignConfigError: naming the first bad setting (``field`` says which).
    """
    try:
        entry = get_model(architecture)
        config = entry.validate(model_config)
    except ModelConfigError as exc:
        field = config_field_name(architecture, exc.field) if exc.field else "architecture"
        raise CampaignConfigError(str(exc), field) from None
    if entry.data_kind != dataset.kind:
        raise CampaignConfigError(
            f"{architecture} trains on {entry.data_kind} data but {dataset} holds {dataset.kind}", "dataset"
        )
    if entry.data_kind == "text" and entry.sample_len(config) != dataset.sample_len:
        field = config_field_name(architecture, "block_size") if "block_size" in entry.fields else "dataset"
        raise CampaignConfigError(
            f"{architecture}.block_size + 1 = {entry.sample_len(config)} must equal the dataset's sample length "
            f"{dataset.sample_len}",
            field,
        )
    spec = validate_optimizer(
        optimizer, max_steps=max_steps, num_aggregators=num_aggregators, tensors=len(entry.param_shapes(config))
    )
    if codec not in CODECS:
        raise CampaignConfigError(f"unknown codec {codec!r}; choose one of {', '.join(CODECS)}", "codec")
    if microbatch_size < 1 or target_batch_size < microbatch_size:
        raise CampaignConfigError(
            f"Microbatch size ({microbatch_size}) must be at least 1 and must not exceed the target batch size "
            f"({target_batch_size})",
            "microbatch_size",
        )
    return config, to_dict(spec), entry.param_count(config)


def validate_optimizer(
    optimizer: dict[str, Any], *, max_steps: int | None = None, num_aggregators: int = 1, tensors: int | None = None
) -> OptimizerSpec:
    """Check an optimizer and its schedule against the registry; a cosine without ``total_steps`` takes ``max_steps``.

    Args:
        optimizer: ``{"name": ..., <hyperparameters>, <schedule fields>}`` as JSON.
        max_steps: the campaign's step limit, if any.
        num_aggregators: how many slices the parameters are cut into.
        tensors: how many parameter tensors the model has (per-tensor optimizers cut slices between tensors).

    Raises:
        CampaignConfigError: naming the first bad field, its value, and what is accepted; ``field`` is the
            hyperparameter's name, ``"optimizer"`` for the optimizer itself, ``"max_steps"`` or
            ``"num_aggregators"`` for a schedule or slicing conflict.
    """
    try:
        entry, hyper, schedule = validate_config(optimizer)
        wire = to_wire(entry.name, {**hyper, **{k: v for k, v in schedule.items() if k != "total_steps"}})
    except OptimizerConfigError as exc:
        field = "optimizer" if exc.field in (None, "name") else exc.field
        raise CampaignConfigError(str(exc), field) from None
    total, warmup = schedule["total_steps"], schedule["warmup_steps"]
    if total is None and schedule["schedule"] == "cosine":
        if max_steps is None:
            raise CampaignConfigError(
                "optimizer.total_steps: a cosine schedule decays until total_steps (or the campaign's max "
                "steps): set max steps, or an explicit total_steps",
                "schedule",
            )
        total = max_steps
    if warmup and max_steps is not None and warmup >= max_steps:
        raise CampaignConfigError(
            f"{setting_name('warmup_steps')} is {warmup}, but must be fewer than max steps ({max_steps})",
            "warmup_steps",
        )
    if total is not None and warmup > total:
        raise CampaignConfigError(
            f"{setting_name('warmup_steps')} is {warmup}, but must be at most total_steps ({total})", "warmup_steps"
        )
    if entry.per_tensor and tensors is not None and num_aggregators > tensors:
        raise CampaignConfigError(
            f"optimizer.name: {entry.label} gives each aggregator whole parameter tensors, but the model has "
            f"{tensors} tensors for {num_aggregators} aggregators; use fewer aggregators or another optimizer",
            "num_aggregators",
        )
    try:
        return from_dict(OptimizerSpec, {**wire, "total_steps": total}, "optimizer")
    except ProtocolError as exc:  # a registered optimizer this protocol version cannot name yet
        raise CampaignConfigError(
            f"{exc}; the site's protocol cannot send {entry.label} to aggregators yet, upgrade crowdtrain-agent",
            "optimizer",
        ) from None


def create_campaign(
    *,
    name: str,
    owner: User,
    dataset: Dataset,
    architecture: str,
    model_config: dict[str, Any],
    optimizer: dict[str, Any] | None = None,
    target_batch_size: int = 256,
    microbatch_size: int = 16,
    codec: str = "fp32",
    **fields: Any,
) -> Campaign:
    """Validate and save a draft campaign, with the bounds the campaign form enforces.

    Raises:
        CampaignConfigError: naming the bad setting; nothing is saved.
    """
    settings = check_settings(
        {"target_batch_size": target_batch_size, "microbatch_size": microbatch_size, "codec": codec, **fields},
        error=CampaignConfigError,
    )
    config, opt, count = validate_campaign(
        dataset=dataset,
        architecture=architecture,
        model_config=model_config,
        optimizer=optimizer or {},
        target_batch_size=target_batch_size,
        microbatch_size=microbatch_size,
        codec=codec,
        max_steps=settings.get("max_steps"),
        num_aggregators=settings.get("num_aggregators", 1),
    )
    return Campaign.objects.create(
        name=name,
        owner=owner,
        dataset=dataset,
        architecture=architecture,
        model_config=config,
        optimizer=opt,
        param_count=count,
        **settings,
    )
