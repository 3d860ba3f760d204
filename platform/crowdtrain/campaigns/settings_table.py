"""Every plain campaign setting, declared once: the form, the lock list, the detail page and the aggregators read it.

A setting here is a column of ``Campaign`` that organizers choose (the model,
dataset and optimizer have registries of their own). Its default is the
model field's, since Django needs it for the column; everything else (group,
label, help, bounds, whether it locks once the campaign starts, whether
aggregators get it, whether the lease path reads it) is here, and so are the
rules between settings (``RULES``). Adding a setting is a model field, its
migration, and one line in ``SETTINGS``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from django.db import models

from crowdtrain_agent.codec import CODECS, MAX_INT8_BLOCK_SIZE, MIN_INT8_BLOCK_SIZE
from crowdtrain_agent.fields import ConfigError, ConfigField
from crowdtrain_agent.optimizers import INNER_OPTIMIZERS

from .models import Campaign

MAX_BATCH = 1 << 24


@dataclass(frozen=True)
class Group:
    """A section of the campaign form and of the detail page's settings."""

    title: str
    hint: str = ""
    folded: bool = False  # shown under "Advanced" until one of its fields has an error


GROUPS: dict[str, Group] = {
    "batch": Group("Batches and codec"),
    "mode": Group(
        "Training mode",
        "sync trains exactly as one machine would; local (DiLoCo) lets each volunteer take several inner steps "
        "per lease and send far fewer bytes per sample, for volunteers on home links. In local mode the optimizer "
        "above is the outer one (SGD with Nesterov momentum, lr 0.7, momentum 0.9 is the usual choice), the target "
        "batch size is the samples of one outer step, the inner batch size is the samples of one inner step, "
        "the check fraction is 0, and a staleness of 1 overlaps each round with the last one's upload (0 runs "
        "rounds in lock step).",
    ),
    "stop": Group(
        "Stop rule and validation",
        "Training stops at max steps, or once the validation loss reaches the target: set one or both.",
    ),
    "robust": Group(
        "Robustness",
        "How aggregators keep a few bad volunteers from spoiling a step, and how much work is checked twice.",
        folded=True,
    ),
    "advanced": Group("Advanced", folded=True),
}


@dataclass(frozen=True)
class Setting:
    """One campaign setting: its column name, its form group, its spec (bounds, label, help).

    ``locks``: agents or aggregators were built from it, so it cannot change
    once the campaign has started. ``to_aggregator``: it travels in every
    slice assignment (a field of ``SliceAssignment`` of the same name). ``lease``: the lease path reads
    it (``scheduler.configs``), so saving it makes every site process re-read the campaign; off only for
    settings it never reads, since a stale copy there hands out leases on old settings.
    """

    name: str
    group: str
    spec: ConfigField
    locks: bool = True
    to_aggregator: bool = False
    lease: bool = True

    @property
    def label(self) -> str:
        return self.spec.label or self.name

    @property
    def default(self) -> Any:
        """The model field's default: the column's, so the form and ``create_campaign`` agree on it."""
        field = Campaign._meta.get_field(self.name)
        assert isinstance(field, models.Field)  # a column of its own, not the far side of a relation
        return field.get_default()

    def describe(self) -> str:
        """How messages name it: the label a person reads, the key a JSON spec uses."""
        return f"{self.label} ({self.name})" if self.label != self.name else self.name


def _int(default_label: str, minimum: int, maximum: int, help: str, **options: Any) -> ConfigField:
    return ConfigField("int", None, minimum, maximum, help, default_label, **options)


SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in [
        Setting("target_batch_size", "batch", _int("Target batch size", 1, MAX_BATCH, "samples in one global step")),
        Setting("microbatch_size", "batch", _int("Microbatch size", 1, MAX_BATCH, "samples an agent computes at once")),
        Setting(
            "codec",
            "batch",
            ConfigField(
                "choice",
                help="how agents encode gradients on the wire",
                label="Gradient codec",
                choices=tuple(CODECS),
            ),
            to_aggregator=True,
        ),
        Setting(
            "codec_block_size",
            "batch",
            _int(
                "Int8 block size",
                MIN_INT8_BLOCK_SIZE,
                MAX_INT8_BLOCK_SIZE,
                "int8 codec: elements sharing one scale; smaller is more exact and costs 4 bytes per block "
                "(any size, a power of two not required)",
            ),
            to_aggregator=True,
        ),
        Setting(
            "mixed_precision",
            "batch",
            ConfigField(
                "bool",
                help="GPU volunteers compute in bf16 autocast (fp16 with a loss scale on GPUs without bf16): "
                "about half the activation memory and far faster; gradients are still sent and summed in fp32. "
                "CPUs always compute in fp32",
                label="Mixed precision on GPUs",
            ),
        ),
        Setting(
            "augmentation",
            "batch",
            ConfigField(
                "choice",
                help="image datasets: flips, or flips and shifted crops, seeded by each sample and version so "
                "every device computing a lease sees the same images",
                label="Image augmentation",
                choices=tuple(Campaign.Augmentation.values),
            ),
        ),
        Setting(
            "training_mode",
            "mode",
            ConfigField(
                "choice",
                help="sync: leases send gradients; local: leases send pseudo-gradients of inner steps (DiLoCo)",
                label="Training mode",
                choices=tuple(Campaign.TrainingMode.values),
            ),
        ),
        Setting(
            "inner_optimizer",
            "mode",
            ConfigField(
                "choice",
                help="local mode: the optimizer each agent runs on its copy of the model, kept between its leases",
                label="Inner optimizer",
                choices=INNER_OPTIMIZERS,
            ),
        ),
        Setting(
            "inner_lr",
            "mode",
            ConfigField(
                "float",
                None,
                0.0,
                10.0,
                "local mode: the inner optimizer's peak learning rate (the schedule above applies to it too)",
                "Inner learning rate",
                open_minimum=True,
            ),
        ),
        Setting(
            "inner_weight_decay",
            "mode",
            ConfigField(
                "float",
                None,
                0.0,
                1.0,
                "local mode: the inner optimizer's weight decay, on matrices and embeddings",
                "Inner weight decay",
            ),
        ),
        Setting(
            "inner_batch_size",
            "mode",
            _int(
                "Inner batch size",
                1,
                1 << 30,
                "local mode: samples per inner step, a multiple of the microbatch size (their gradients add up); "
                "blank: one microbatch. Every inner step updates all parameters, so a larger inner batch spends "
                "less of a volunteer's time in the optimizer",
                optional=True,
            ),
        ),
        Setting(
            "max_steps",
            "stop",
            _int("Max steps", 1, 1 << 30, "finish after this many steps", optional=True),
            locks=False,
        ),
        Setting(
            "target_val_loss",
            "stop",
            ConfigField(
                "float",
                None,
                0.0,
                1e30,
                "finish once the held-out loss is at most this",
                "Target validation loss",
                open_minimum=True,
                optional=True,
            ),
            locks=False,
            lease=False,
        ),
        Setting(
            "validate_every",
            "stop",
            _int(
                "Validate every",
                0,
                1 << 20,
                "steps between held-out losses (and exportable versions); 0 = only at the finish",
            ),
            locks=False,
            lease=False,
        ),
        Setting(
            "seed",
            "advanced",
            _int("Seed", 0, 2**62, "initial weights are the same on every machine"),
            to_aggregator=True,
            lease=False,
        ),
        Setting("num_aggregators", "advanced", _int("Aggregators", 1, 64, "slices the parameters are split into")),
        Setting("staleness", "advanced", _int("Staleness", 0, 4, "0 = fully synchronous"), to_aggregator=True),
        Setting(
            "checkpoint_every",
            "advanced",
            _int("Checkpoint every", 1, 1 << 20, "steps between checkpoints"),
            to_aggregator=True,
        ),
        Setting(
            "max_grad_norm",
            "advanced",
            ConfigField(
                "float",
                None,
                0.0,
                1e30,
                "uploads whose gradient norm per sample is above this are refused; 0 disables",
                "Max gradient norm",
            ),
            to_aggregator=True,
            lease=False,
        ),
        Setting(
            "aggregation",
            "robust",
            ConfigField(
                "choice",
                help="mean: every sample counts the same; trimmed_mean or centered_clip: each lease is one vote, "
                "and a minority of bad leases cannot drag the step",
                label="Aggregation",
                choices=tuple(Campaign.Aggregation.values),
            ),
            to_aggregator=True,
        ),
        Setting(
            "clip_factor",
            "robust",
            ConfigField(
                "float",
                None,
                0.0,
                1e6,
                "each lease's gradient norm per sample is clipped to this many times the median of the recent "
                "ones; 0 disables",
                "Clip factor",
            ),
            to_aggregator=True,
            lease=False,
        ),
        Setting(
            "trim_fraction",
            "robust",
            ConfigField(
                "float",
                None,
                0.0,
                0.5,
                "trimmed mean: the share of the largest and of the smallest values dropped per coordinate",
                "Trim fraction",
                open_maximum=True,
            ),
            to_aggregator=True,
        ),
        Setting(
            "check_fraction",
            "robust",
            ConfigField(
                "float",
                None,
                0.0,
                1.0,
                "share of leases also computed by another volunteer to verify them",
                "Check fraction",
            ),
            locks=False,
        ),
    ]
}


@dataclass(frozen=True)
class Rule:
    """A rule between settings: while ``when`` (a setting, a value) holds, ``field`` must be ``value``.

    The one statement of it: ``validate_campaign`` and the campaign form refuse other values, the form's
    script moves the field to ``value`` when ``when`` is chosen (``rules_for_page``), and the lease path
    acts on ``value`` whatever was saved another way (``acted_on``).
    """

    when: tuple[str, Any]
    field: str
    value: Any
    why: str  # completes "<field> is <its value>, but ..."

    def applies(self, values: Mapping[str, Any]) -> bool:
        setting, value = self.when
        return bool(values.get(setting) == value)

    def broken_by(self, values: Mapping[str, Any]) -> bool:
        return self.applies(values) and values.get(self.field, SETTINGS[self.field].default) != self.value

    def message(self, values: Mapping[str, Any]) -> str:
        value = values.get(self.field, SETTINGS[self.field].default)
        return f"{SETTINGS[self.field].label} is {display(value)}, but {self.why}"


RULES: tuple[Rule, ...] = (
    Rule(
        when=("training_mode", Campaign.TrainingMode.LOCAL),
        field="check_fraction",
        value=0.0,
        # A local lease's pseudo-gradient depends on the inner optimizer's state on the volunteer's own
        # machine (kept between its leases), so no other volunteer can recompute it to compare.
        why="local mode cannot verify leases by a second copy: each pseudo-gradient depends on the inner "
        "optimizer state of the volunteer who made it. Set the check fraction to 0 (robust aggregation still "
        "guards the steps) or use sync mode",
    ),
)


def check_rules(values: Mapping[str, Any], *, error: type[Exception] = ConfigError) -> None:
    """Refuse values that break a rule between settings.

    Raises:
        error: called as ``error(message, field)`` for the first rule broken, naming the field to change.
    """
    for rule in RULES:
        if rule.broken_by(values):
            raise error(rule.message(values), rule.field)


def acted_on(campaign: Campaign, name: str) -> Any:
    """The value of a setting the platform acts on: a rule's where one applies, however the campaign was saved."""
    values = {setting: getattr(campaign, setting) for setting in SETTINGS}
    for rule in RULES:
        if rule.field == name and rule.applies(values):
            return rule.value
    return values[name]


def rules_for_page() -> list[dict[str, Any]]:
    """The rules as the campaign form's script reads them: it moves a field still at its default."""
    return [
        {"when": list(rule.when), "field": rule.field, "value": rule.value, "default": SETTINGS[rule.field].default}
        for rule in RULES
    ]


# What agents and aggregators built the model from, besides the plain settings that lock.
LOCKED_CONFIG = ("dataset", "architecture", "model_config", "optimizer")


def lease_settings() -> frozenset[str]:
    """The settings the lease path reads: saving one of them makes every site process re-read the campaign."""
    return frozenset(s.name for s in SETTINGS.values() if s.lease)


def locked_fields() -> tuple[str, ...]:
    """Campaign fields that cannot change once the campaign has started."""
    return (*LOCKED_CONFIG, *(s.name for s in SETTINGS.values() if s.locks))


def check_settings(values: Mapping[str, Any], *, error: type[Exception] = ConfigError) -> dict[str, Any]:
    """``values`` with every setting of the table checked against its bounds; other keys pass through.

    Args:
        values: campaign fields as a spec or a form gives them.
        error: the exception class to raise, called as ``error(message, field)``.

    Raises:
        error: naming the first setting out of bounds, with its value and the accepted range.
    """
    checked = dict(values)
    for name, value in values.items():
        setting = SETTINGS.get(name)
        if setting is None:
            continue
        try:
            checked[name] = setting.spec.check(value, setting.describe(), field=name)
        except ConfigError as exc:
            raise error(str(exc), name) from None
    return checked


def aggregator_settings(campaign: Campaign) -> dict[str, Any]:
    """The settings every slice assignment carries, by their ``SliceAssignment`` field names."""
    return {s.name: getattr(campaign, s.name) for s in SETTINGS.values() if s.to_aggregator}


def summary(campaign: Campaign) -> list[tuple[Group, list[tuple[Setting, str]]]]:
    """The campaign's settings by group, each value as the detail page shows it."""
    return [
        (group, [(s, display(getattr(campaign, s.name))) for s in SETTINGS.values() if s.group == key])
        for key, group in GROUPS.items()
    ]


def display(value: Any) -> str:
    """A setting's value in words: ``none`` for an unset optional one, floats without trailing zeros."""
    if value is None:
        return "none"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)
