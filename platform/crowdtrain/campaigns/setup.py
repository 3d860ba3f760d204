"""Creating and validating campaigns: one set of checks for the form, create_campaign, seed_run and the admin."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from django.conf import settings as django_settings

from crowdtrain.datasets.models import Dataset, Pretrained
from crowdtrain.datasets.pretrained import HEAD_FIELDS, campaign_weights
from crowdtrain_agent.codec import CODECS
from crowdtrain_agent.models import REGISTRY, ModelConfigError, ModelEntry, get_model
from crowdtrain_agent.optimizers import (
    INNER_OPTIMIZERS,
    OptimizerConfigError,
    setting_name,
    to_wire,
    validate_config,
)
from crowdtrain_agent.protocol import DataSpec, Lease, OptimizerSpec, ProtocolError, SliceAssignment
from crowdtrain_agent.protocol.schema import from_dict, to_dict

from .models import Campaign
from .settings_table import SETTINGS, check_rules, check_settings

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


def validate_campaign(values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any], int]:
    """Check a campaign's settings against the registries, its dataset and the rules between settings.

    The form, the admin, ``create_campaign`` and the start of a campaign all call it, so every way in
    accepts the same campaigns. The inner optimizer's settings are checked in sync mode too, so switching
    a draft to local later finds no surprise.

    Args:
        values: ``dataset``, ``architecture``, ``model_config`` and ``optimizer``, optionally ``pretrained``,
            and settings of the table by their names (a missing one takes its default); other keys are
            ignored.

    Returns:
        (normalized model config, normalized optimizer, parameter count).

    Raises:
        CampaignConfigError: naming the first bad setting (``field`` says which).
    """
    values = {**{name: setting.default for name, setting in SETTINGS.items()}, **values}
    dataset: Dataset = values["dataset"]
    architecture: str = values["architecture"]
    pretrained: Pretrained | None = values.get("pretrained")
    augmentation: str = values["augmentation"]
    microbatch_size: int = values["microbatch_size"]
    target_batch_size: int = values["target_batch_size"]
    codec: str = values["codec"]
    try:
        entry = get_model(architecture)
        config = entry.validate(values["model_config"])
    except ModelConfigError as exc:
        field = config_field_name(architecture, exc.field) if exc.field else "architecture"
        raise CampaignConfigError(str(exc), field) from None
    # A text architecture trains on bytes or on the ids of a tokenized text alike.
    reads = {"text": (Dataset.Kind.TEXT, Dataset.Kind.TOKENS)}.get(entry.data_kind, (entry.data_kind,))
    if dataset.kind not in reads:
        raise CampaignConfigError(
            f"{architecture} trains on {entry.data_kind} data but {dataset} holds {dataset.kind}", "dataset"
        )
    if entry.data_kind == "text" and entry.sample_len(config) != dataset.sample_len:
        field = config_field_name(architecture, "block_size") if "block_size" in entry.fields else "dataset"
        unit = "token ids" if dataset.kind == Dataset.Kind.TOKENS else "bytes"
        raise CampaignConfigError(
            f"{architecture}.block_size + 1 = {entry.sample_len(config)} must equal the dataset's sample length "
            f"{dataset.sample_len} ({unit})",
            field,
        )
    check_images(architecture, entry, config, dataset, augmentation)
    if pretrained is not None:
        check_pretrained(architecture, entry, config, dataset, pretrained)
    # Neither is advisory: a peer of an older minor would train something else, so none may be sent them.
    for what, needs, used in (
        ("image augmentation", DataSpec.since["augment"], augmentation != Campaign.Augmentation.NONE),
        ("starting from pretrained weights", SliceAssignment.since["initial"], pretrained is not None),
    ):
        if used and needs > django_settings.CROWDTRAIN_PROTOCOL_MINOR:
            raise CampaignConfigError(
                f"{what} needs protocol 2.{needs}, and this site is pinned to "
                f"2.{django_settings.CROWDTRAIN_PROTOCOL_MINOR} (CROWDTRAIN_PROTOCOL_MINOR)",
                "augmentation" if what == "image augmentation" else "pretrained",
            )
    if dataset.kind == Dataset.Kind.TOKENS:
        needs = DataSpec.since_values["kind"]["tokens"]
        if needs > django_settings.CROWDTRAIN_PROTOCOL_MINOR:
            raise CampaignConfigError(
                f"a tokenized dataset needs protocol 2.{needs}, and this site is pinned to "
                f"2.{django_settings.CROWDTRAIN_PROTOCOL_MINOR} (CROWDTRAIN_PROTOCOL_MINOR); upload the text "
                "without a tokenizer",
                "dataset",
            )
        try:
            entry.check_vocab(config, dataset.vocab_size)
        except ModelConfigError as exc:
            raise CampaignConfigError(
                str(exc), config_field_name(architecture, exc.field) if exc.field else "architecture"
            ) from None
    spec = validate_optimizer(
        values["optimizer"],
        max_steps=values["max_steps"],
        num_aggregators=values["num_aggregators"],
        tensors=len(entry.param_shapes(config)),
    )
    if codec not in CODECS:
        raise CampaignConfigError(f"unknown codec {codec!r}; choose one of {', '.join(CODECS)}", "codec")
    needs = Lease.since_values["codec"].get(codec, 0)
    if needs > django_settings.CROWDTRAIN_PROTOCOL_MINOR:
        # Every agent and aggregator speaks the pinned minor here, and none of them could read the codec.
        raise CampaignConfigError(
            f"the {codec} codec needs protocol 2.{needs}, and this site is pinned to "
            f"2.{django_settings.CROWDTRAIN_PROTOCOL_MINOR} (CROWDTRAIN_PROTOCOL_MINOR); choose another codec",
            "codec",
        )
    if microbatch_size < 1 or target_batch_size < microbatch_size:
        raise CampaignConfigError(
            f"Microbatch size ({microbatch_size}) must be at least 1 and must not exceed the target batch size "
            f"({target_batch_size})",
            "microbatch_size",
        )
    check_training_mode(values["training_mode"], values, values["staleness"])
    check_rules(values, error=CampaignConfigError)
    check_inner_batch(values["inner_batch_size"], microbatch_size, target_batch_size)
    count = entry.param_count(config)
    if count > django_settings.CROWDTRAIN_MAX_MODEL_PARAMS:
        raise CampaignConfigError(
            f"{architecture} with this config has {count:,} parameters (counted from the config), more than "
            f"the {django_settings.CROWDTRAIN_MAX_MODEL_PARAMS:,} this site trains (CROWDTRAIN_MAX_MODEL_PARAMS); "
            "choose fewer or narrower layers",
            "architecture",
        )
    return config, to_dict(spec), count


# Fields a campaign may set apart from its pretrained weights' when the parameter shapes stay the same:
# the context length of a RoPE model, the image size of a convolutional one.
INPUT_SIZES = ("block_size", "image_size")


def check_pretrained(
    architecture: str, entry: ModelEntry, config: dict[str, Any], dataset: Dataset, pretrained: Pretrained
) -> None:
    """A campaign starting from pretrained weights builds their model and reads ids of their tokenizer.

    Raises:
        CampaignConfigError: naming the field that differs from the weights.
    """
    if pretrained.status != Pretrained.Status.READY:
        raise CampaignConfigError(
            f"the pretrained weights {pretrained} are {pretrained.status}, not ready", "pretrained"
        )
    if architecture != pretrained.architecture:
        raise CampaignConfigError(
            f"the pretrained weights are a {pretrained.architecture}; choose that architecture", "architecture"
        )
    theirs = entry.validate(pretrained.model_config)
    # Shapes apart from the head, which may be new: is a smaller context or image all that differs?
    headed = {**theirs, **{name: config[name] for name in HEAD_FIELDS if name in theirs}}
    same_shapes = entry.param_shapes(config) == entry.param_shapes(headed)
    for name in entry.fields:
        if config[name] == theirs[name] or (name in INPUT_SIZES and same_shapes) or name in HEAD_FIELDS:
            continue  # a new head starts from the campaign's seed (``pretrained.campaign_weights``)
        raise CampaignConfigError(
            f"{architecture}.{name} is {config[name]}, but the pretrained weights have {theirs[name]}; a campaign "
            "that starts from them keeps their model",
            config_field_name(architecture, name),
        )
    if pretrained.tokenizer_sha256 and dataset.tokenizer_sha256 != pretrained.tokenizer_sha256:
        raise CampaignConfigError(
            f"{dataset} was not tokenized with the pretrained weights' tokenizer; upload the text again choosing "
            f"the tokenizer of {pretrained.name}, so the ids mean what the weights learned",
            "dataset",
        )


def initial_weights_sha(campaign: Campaign) -> str | None:
    """The sha256 of version 0 of a campaign starting from pretrained weights (None: it starts from its seed).

    Slow for a large model (it reads the weights and may write a version with
    a head of the campaign's own), so callers run it outside any transaction.

    Raises:
        OSError: the stored weights are gone or unreadable.
    """
    weights = campaign.pretrained
    if weights is None:
        return None
    return campaign_weights(
        weights.weights_sha256, campaign.architecture, weights.model_config, campaign.model_config, campaign.seed
    )


def initial_weights_inputs(campaign: Campaign) -> tuple[object, ...]:
    """What ``initial_weights_sha`` depends on: a sha computed for other inputs is not this campaign's."""
    return (campaign.pretrained_id, campaign.architecture, repr(campaign.model_config), campaign.seed)


def prepare_initial_weights(campaign: Campaign, sha: str | None = None) -> None:
    """Store version 0 of a campaign starting from pretrained weights with a head of its own; at its start.

    Before any aggregator is assigned a slice, so every one of them fetches the same vector.
    ``sha``: ``initial_weights_sha`` computed beforehand (None: computed here).
    """
    if campaign.pretrained_id is None:
        return
    sha = sha or initial_weights_sha(campaign)
    if sha and sha != campaign.initial_weights:
        campaign.initial_weights = sha
        Campaign.objects.filter(pk=campaign.pk).update(initial_weights=sha)


def check_images(
    architecture: str, entry: ModelEntry, config: dict[str, Any], dataset: Dataset, augmentation: str
) -> None:
    """An uploaded image dataset trains an image family of its size and classes; only images are augmented.

    Raises:
        CampaignConfigError: naming the model field (or the augmentation) to change.
    """
    if not dataset.image_size:
        if augmentation != Campaign.Augmentation.NONE:
            raise CampaignConfigError(
                f"augmentation {augmentation!r} changes images, and {dataset} holds no uploaded images; choose none",
                "augmentation",
            )
        return
    if "image_size" not in entry.fields:
        families = ", ".join(n for n, e in REGISTRY.items() if "image_size" in e.fields)
        raise CampaignConfigError(
            f"{dataset} holds images; {architecture} does not read images, choose one of {families}", "architecture"
        )
    wanted = {"image_size": dataset.image_size, "num_channels": 3}
    for name, value in wanted.items():
        if config[name] != value:
            raise CampaignConfigError(
                f"{architecture}.{name} is {config[name]}, but the dataset's images are {dataset.image_size} x "
                f"{dataset.image_size} RGB; set {name} to {value}",
                config_field_name(architecture, name),
            )
    if config["num_labels"] < len(dataset.labels):
        raise CampaignConfigError(
            f"{architecture}.num_labels is {config['num_labels']}, but the dataset has {len(dataset.labels)} "
            f"classes; set num_labels to at least {len(dataset.labels)}",
            config_field_name(architecture, "num_labels"),
        )


def check_inner_batch(inner_batch_size: int | None, microbatch_size: int, target_batch_size: int) -> None:
    """An inner batch is whole microbatches, and no more than a round (the target batch) holds.

    Raises:
        CampaignConfigError: naming ``inner_batch_size``.
    """
    if inner_batch_size is None:
        return
    if inner_batch_size < 1 or inner_batch_size % microbatch_size:
        raise CampaignConfigError(
            f"Inner batch size ({inner_batch_size}) must be a multiple of the microbatch size ({microbatch_size}): "
            "an inner step adds up the gradients of whole microbatches",
            "inner_batch_size",
        )
    if inner_batch_size > target_batch_size:
        raise CampaignConfigError(
            f"Inner batch size ({inner_batch_size}) must not exceed the target batch size ({target_batch_size}), "
            "the samples of one outer step",
            "inner_batch_size",
        )


def check_training_mode(training_mode: str, inner: Mapping[str, Any], staleness: int = 0) -> OptimizerSpec:
    """Check the local mode's settings; returns the inner optimizer's spec (unscheduled).

    Local mode runs at staleness 0 (rounds in lock step, as DiLoCo) or 1 (overlapped rounds: the next
    round's leases go out while the last one is uploaded and published, and agents rebase onto the new
    version when it arrives, ``Lease.rebase_to``). A deeper window would have agents train whole leases
    on a guess of a version two rounds away; naively applied one version late, a pseudo-gradient repeats
    the movement the round before already made (W1, one agent at staleness 1 without rebasing: validation
    loss 2.09 after 98,304 samples, against 0.40 at staleness 0; ``tests.benchmarks.homelink``).

    Raises:
        CampaignConfigError: for an unknown mode, a bad inner setting, a staleness above 1 (above 0 on a
            site pinned below protocol 2.4). The rules between settings (``settings_table.RULES``) are
            ``validate_campaign``'s.
    """
    if training_mode not in ("sync", "local"):
        raise CampaignConfigError(f"unknown training mode {training_mode!r}; choose sync or local", "training_mode")
    spec = inner_optimizer_spec(
        inner.get("inner_optimizer", "adamw"), inner.get("inner_lr", 1e-3), inner.get("inner_weight_decay", 0.0)
    )
    if training_mode == "local":
        needs = Lease.since["mode"]
        if needs > django_settings.CROWDTRAIN_PROTOCOL_MINOR:
            raise CampaignConfigError(
                f"local mode needs protocol 2.{needs}, and this site is pinned to "
                f"2.{django_settings.CROWDTRAIN_PROTOCOL_MINOR} (CROWDTRAIN_PROTOCOL_MINOR); use sync mode",
                "training_mode",
            )
        overlap = Lease.since["rebase_to"]
        if staleness > 1:
            raise CampaignConfigError(
                f"Staleness is {staleness}, but local mode overlaps at most one round: set it to 1 (the next round "
                "starts while the last one is uploaded and published) or 0 (rounds in lock step)",
                "staleness",
            )
        if staleness == 1 and overlap > django_settings.CROWDTRAIN_PROTOCOL_MINOR:
            raise CampaignConfigError(
                f"Staleness is 1, but overlapped local rounds need protocol 2.{overlap}, and this site is pinned "
                f"to 2.{django_settings.CROWDTRAIN_PROTOCOL_MINOR} (CROWDTRAIN_PROTOCOL_MINOR); set the staleness "
                "to 0",
                "staleness",
            )
    return spec


def inner_optimizer_spec(name: Any, lr: Any, weight_decay: Any) -> OptimizerSpec:
    """The inner optimizer of a local-mode campaign as leases carry it: the registry's defaults but for these.

    Raises:
        CampaignConfigError: naming the inner setting at fault.
    """
    if name not in INNER_OPTIMIZERS:
        raise CampaignConfigError(
            f"unknown inner optimizer {name!r}; agents run {' or '.join(INNER_OPTIMIZERS)} themselves",
            "inner_optimizer",
        )
    try:
        entry, hyper, _ = validate_config({"name": name, "lr": lr, "weight_decay": weight_decay})
        wire = to_wire(entry.name, {k: v for k, v in hyper.items() if k in entry.hyperparameters})
    except OptimizerConfigError as exc:
        field = {"lr": "inner_lr", "weight_decay": "inner_weight_decay"}.get(exc.field or "", "inner_optimizer")
        raise CampaignConfigError(f"inner optimizer: {exc}", field) from None
    return from_dict(OptimizerSpec, wire, "inner optimizer")


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
    pretrained: Pretrained | None = None,
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
        {
            **settings,
            "dataset": dataset,
            "architecture": architecture,
            "model_config": model_config,
            "optimizer": optimizer or {},
            "pretrained": pretrained,
        }
    )
    return Campaign.objects.create(
        name=name,
        owner=owner,
        dataset=dataset,
        pretrained=pretrained,
        architecture=architecture,
        model_config=config,
        optimizer=opt,
        param_count=count,
        **settings,
    )
