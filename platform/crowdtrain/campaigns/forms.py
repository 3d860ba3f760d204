"""The organizer's campaign form: model config fields come from the agent's registry schema.

Every architecture's config fields are in the form (named ``<architecture>__<field>``);
the page shows the selected architecture's set and only that set is read. Values are
checked by the registry's own ``validate`` and by ``validate_campaign``, and each
error is put next to the field it names.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import Any

from django import forms
from django.db import transaction
from django.db.models import QuerySet

from crowdtrain.accounts.models import new_invite_code
from crowdtrain_agent.codec import CODECS
from crowdtrain_agent.models import REGISTRY, ModelConfigError
from crowdtrain_agent.models.registry import ConfigField
from crowdtrain_agent.protocol import OptimizerSpec

from .lifecycle import LOCK_REASON, LOCKED_FIELDS, config_locked
from .models import Campaign, Dataset
from .permissions import visible_datasets
from .setup import CampaignConfigError, validate_campaign

# The hyperparameters each optimizer reads; the page shows only these for the chosen one.
OPTIMIZER_FIELDS = {
    "adamw": ("lr", "beta1", "beta2", "eps", "weight_decay"),
    "lamb": ("lr", "beta1", "beta2", "eps", "weight_decay"),
    "sgd": ("lr", "momentum", "weight_decay"),
}
OPTIMIZER_LABELS = {"adamw": "AdamW", "sgd": "SGD with momentum", "lamb": "LAMB"}
SCHEDULE_FIELDS = ("warmup_steps", "schedule", "min_lr_ratio")
MAX_BATCH = 1 << 24


def config_field_name(architecture: str, field: str) -> str:
    return f"{architecture}__{field}"


def optimizer_names() -> list[str]:
    """The optimizers the shared protocol (and so every aggregator) knows."""
    hint = typing.get_type_hints(OptimizerSpec)["name"]
    return list(typing.get_args(hint))


def _spec_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(OptimizerSpec)}


def datasets_for(user: Any) -> QuerySet[Dataset]:
    """Datasets ``user`` may train on: their own (staff: any) that have finished splitting into shards."""
    return visible_datasets(user).filter(status=Dataset.Status.READY).order_by("-created_at", "-id")


def _messages(label: str, **extra: str) -> dict[str, str]:
    # Django's defaults ("Enter a whole number.") do not say which field is wrong.
    return {
        "required": f"{label} is required.",
        "invalid": f"{label}: enter a number.",
        "min_value": f"{label} must be at least %(limit_value)s.",
        "max_value": f"{label} must be at most %(limit_value)s.",
        "invalid_choice": f"{label}: %(value)s is not one of the choices.",
        **extra,
    }


def _int(label: str, help_text: str = "", **kwargs: Any) -> forms.IntegerField:
    return forms.IntegerField(
        label=label, help_text=help_text, error_messages=_messages(label, invalid=f"{label}: enter a whole number."),
        **kwargs,
    )


def _float(label: str, help_text: str = "", **kwargs: Any) -> forms.FloatField:
    return forms.FloatField(label=label, help_text=help_text, error_messages=_messages(label), **kwargs)


def _registry_field(architecture: str, name: str, spec: ConfigField) -> forms.Field:
    label = f"{name}"
    help_text = f"{spec.help} ({spec.minimum:g} to {spec.maximum:g})".strip()
    attrs = {"data-architecture": architecture}
    if spec.kind == "int_list":
        return forms.CharField(
            label=label, help_text=f"{help_text}; comma-separated", initial=", ".join(str(v) for v in spec.default),
            required=False,
            error_messages=_messages(f"{architecture}.{name}"), widget=forms.TextInput(attrs=attrs),
        )
    field_class = forms.IntegerField if spec.kind == "int" else forms.FloatField
    # Bounds are left to the registry's validate, whose messages name the field and the range.
    return field_class(
        label=label, help_text=help_text, initial=spec.default, error_messages=_messages(f"{architecture}.{name}"),
        required=False,
        widget=forms.NumberInput(attrs={**attrs, "step": "1" if spec.kind == "int" else "any"}),
    )


class DatasetChoiceField(forms.ModelChoiceField):
    def label_from_instance(self, obj: Dataset) -> str:
        # The sample length is what a text model's block_size must match (block_size + 1 bytes per sample).
        shape = f", {obj.sample_len}-byte samples" if obj.kind == Dataset.Kind.TEXT else ""
        return f"{obj.name} ({obj.kind}, {obj.num_samples} samples{shape})"


class CampaignForm(forms.Form):
    name = forms.CharField(max_length=200, error_messages=_messages("Name"))
    description = forms.CharField(
        required=False, max_length=5000, widget=forms.Textarea(attrs={"rows": 4}),
        help_text="What the model is for; volunteers see it on the join page.",
    )
    visibility = forms.ChoiceField(
        choices=Campaign.Visibility.choices, initial=Campaign.Visibility.PUBLIC, widget=forms.RadioSelect,
        error_messages=_messages("Visibility"),
    )
    dataset = DatasetChoiceField(
        queryset=Dataset.objects.none(), error_messages=_messages("Dataset"),
        help_text="One of your datasets that has finished splitting into shards.",
    )
    architecture = forms.ChoiceField(
        choices=[(name, f"{name}: {entry.description}") for name, entry in REGISTRY.items()],
        error_messages=_messages("Architecture"),
    )
    optimizer = forms.ChoiceField(choices=[], initial="adamw", error_messages=_messages("Optimizer"))
    lr = _float("Learning rate", "peak learning rate", initial=1e-3)
    beta1 = _float("beta1", "first-moment decay, in [0, 1)", required=False, initial=0.9)
    beta2 = _float("beta2", "second-moment decay, in [0, 1)", required=False, initial=0.999)
    eps = _float("eps", "added to the denominator, > 0", required=False, initial=1e-8)
    weight_decay = _float("Weight decay", "decoupled weight decay, >= 0", required=False, initial=0.0)
    momentum = _float("Momentum", "SGD momentum, in [0, 1)", required=False, initial=0.9)
    warmup_steps = _int(
        "Warmup steps", "linear warmup from 0 over this many steps", required=False, initial=0, min_value=0
    )
    schedule = forms.ChoiceField(
        choices=[("constant", "constant"), ("cosine", "cosine")], initial="constant",
        error_messages=_messages("Schedule"), help_text="after warmup: constant, or cosine decay until max steps",
    )
    min_lr_ratio = _float("Minimum LR ratio", "the cosine ends at lr × this, in [0, 1]", required=False, initial=0.0)
    target_batch_size = _int(
        "Target batch size", "samples in one global step", initial=256, min_value=1, max_value=MAX_BATCH
    )
    microbatch_size = _int(
        "Microbatch size", "samples an agent computes at once", initial=16, min_value=1, max_value=MAX_BATCH
    )
    codec = forms.ChoiceField(
        choices=[(name, name) for name in CODECS], initial="fp32", error_messages=_messages("Gradient codec"),
        label="Gradient codec", help_text="how agents encode gradients on the wire",
    )
    max_steps = _int("Max steps", "finish after this many steps", required=False, min_value=1)
    target_val_loss = _float(
        "Target validation loss", "finish once the held-out loss is at most this", required=False, min_value=1e-12
    )
    seed = _int("Seed", "initial weights are the same on every machine", initial=0, min_value=0, max_value=2**62)
    num_aggregators = _int("Aggregators", "slices the parameters are split into", initial=1, min_value=1, max_value=64)
    staleness = _int("Staleness", "0 = fully synchronous", initial=1, min_value=0, max_value=4)
    checkpoint_every = _int("Checkpoint every", "steps between checkpoints", initial=10, min_value=1, max_value=1 << 20)
    validate_every = _int(
        "Validate every", "steps between held-out losses (and exportable versions); 0 = only at the finish",
        initial=10, min_value=0, max_value=1 << 20, required=False,
    )

    field_order = [
        "name", "description", "visibility", "dataset", "architecture", "optimizer", "lr", "beta1", "beta2", "eps",
        "weight_decay", "momentum", "warmup_steps", "schedule", "min_lr_ratio", "target_batch_size", "microbatch_size",
        "codec", "max_steps", "target_val_loss", "validate_every", "seed", "num_aggregators", "staleness",
        "checkpoint_every",
    ]

    def __init__(self, *args: Any, user: Any, instance: Campaign | None = None, **kwargs: Any) -> None:
        if instance is not None:
            kwargs.setdefault("initial", self._initial_from(instance))
        super().__init__(*args, **kwargs)
        self.user = user
        self.instance = instance
        self.locked = instance is not None and config_locked(instance)
        self.lock_reason = LOCK_REASON if self.locked else ""
        self.model_config: dict[str, Any] = {}
        self.optimizer_spec: dict[str, Any] = {}
        self.param_count = 0
        datasets = datasets_for(user)
        if instance is not None:  # keep the current dataset selectable even if it is not the user's own
            datasets = datasets | Dataset.objects.filter(pk=instance.dataset_id)
        self.fields["dataset"].queryset = datasets
        self.fields["optimizer"].choices = [(n, OPTIMIZER_LABELS.get(n, n)) for n in optimizer_names()]
        for architecture, entry in REGISTRY.items():
            for name, spec in entry.fields.items():
                self.fields[config_field_name(architecture, name)] = _registry_field(architecture, name, spec)
        if self.locked:
            for name, field in self.fields.items():
                if self._is_locked(name):
                    field.disabled = True
            total = (instance.optimizer or {}).get("total_steps") if instance else None
            if total:  # the aggregators hold the schedule: its length stays what it was at the start
                self.fields["max_steps"].help_text += f"; the learning-rate schedule still ends at step {total}"

    # --------------------------------------------------------------- layout helpers for the template

    def _is_locked(self, name: str) -> bool:
        if "__" in name:
            return True  # model config
        optimizer_part = name in ("optimizer", *OPTIMIZER_FIELDS["adamw"], "momentum", *SCHEDULE_FIELDS)
        return optimizer_part or name in LOCKED_FIELDS

    def config_sets(self) -> list[tuple[str, str, list[forms.BoundField]]]:
        """(architecture, description, its bound config fields) for each registry entry."""
        return [
            (arch, entry.description, [self[config_field_name(arch, name)] for name in entry.fields])
            for arch, entry in REGISTRY.items()
        ]

    def optimizer_field_map(self) -> dict[str, list[str]]:
        return {name: list(OPTIMIZER_FIELDS.get(name, OPTIMIZER_FIELDS["adamw"])) for name in optimizer_names()}

    @staticmethod
    def _initial_from(campaign: Campaign) -> dict[str, Any]:
        initial: dict[str, Any] = {
            name: getattr(campaign, name)
            for name in ("name", "description", "visibility", "architecture", "target_batch_size", "microbatch_size",
                         "codec", "max_steps", "target_val_loss", "validate_every", "seed", "num_aggregators",
                         "staleness", "checkpoint_every")
        }  # fmt: skip
        initial["dataset"] = campaign.dataset_id
        optimizer = dict(campaign.optimizer or {})
        initial["optimizer"] = optimizer.get("name", "adamw")
        for key in ("lr", "beta1", "beta2", "eps", "weight_decay", "momentum", *SCHEDULE_FIELDS):
            if key in optimizer:
                initial[key] = optimizer[key]
        for name, value in (campaign.model_config or {}).items():
            initial[config_field_name(campaign.architecture, name)] = (
                ", ".join(str(v) for v in value) if isinstance(value, list) else value
            )
        return initial

    # --------------------------------------------------------------- validation

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        self._drop_unused_errors(data)
        if self.instance is not None and self.instance.state != Campaign.State.DRAFT:
            self._clean_started(data)
        if self.locked:
            return data  # a started campaign may also lose its stop rule: its organizer finishes it by hand
        if data.get("max_steps") is None and data.get("target_val_loss") is None and "max_steps" not in self.errors:
            self.add_error("max_steps", "Set a stop rule: max steps, a target validation loss, or both.")
        self._clean_model_config(data)
        self._clean_optimizer(data)
        target, micro = data.get("target_batch_size"), data.get("microbatch_size")
        if target is not None and micro is not None and micro > target:
            self.add_error(
                "microbatch_size", f"Microbatch size ({micro}) must not exceed the target batch size ({target})."
            )
        if not self.errors:
            self._clean_together(data)
        return data

    def _drop_unused_errors(self, data: dict[str, Any]) -> None:
        # Hidden fields of another architecture or optimizer are not read, so their values cannot be wrong.
        architecture = data.get("architecture") or self.data.get("architecture")
        used = set(OPTIMIZER_FIELDS.get(data.get("optimizer") or "", ()))
        for key in list(self._errors):
            other_arch = "__" in key and not key.startswith(f"{architecture}__")
            unused_hyper = key in ("beta1", "beta2", "eps", "weight_decay", "momentum") and used and key not in used
            if other_arch or unused_hyper:
                del self._errors[key]

    def _clean_started(self, data: dict[str, Any]) -> None:
        done = self.instance.committed_steps if self.instance else 0
        max_steps = data.get("max_steps")
        if max_steps is not None and max_steps <= done:
            self.add_error("max_steps", f"Max steps must be more than the {done} steps already made.")

    def _clean_model_config(self, data: dict[str, Any]) -> None:
        architecture = data.get("architecture")
        if architecture not in REGISTRY:
            return
        entry = REGISTRY[architecture]
        config: dict[str, Any] = {}
        for name, spec in entry.fields.items():
            key = config_field_name(architecture, name)
            if key not in data:
                continue  # its own error is already shown
            value = data[key]
            if value is None or value == "":
                self.add_error(key, f"{architecture}.{name} is required.")
                continue
            if spec.kind == "int_list":
                try:
                    value = [int(part) for part in str(value).replace(" ", "").split(",") if part != ""]
                except ValueError:
                    self.add_error(
                        key, f"{architecture}.{name}: enter whole numbers separated by commas, got {value!r}."
                    )
                    continue
            config[name] = value
        if any(config_field_name(architecture, name) in self.errors for name in entry.fields):
            return
        try:
            self.model_config = entry.validate(config)
        except ModelConfigError as exc:
            self.add_error(self._field_named_in(str(exc), architecture), str(exc))

    @staticmethod
    def _field_named_in(message: str, architecture: str) -> str | None:
        match = re.search(rf"\b{re.escape(architecture)}\.(\w+)", message)
        if match and match.group(1) in REGISTRY[architecture].fields:
            return config_field_name(architecture, match.group(1))
        return "architecture"

    def _clean_optimizer(self, data: dict[str, Any]) -> None:
        name = data.get("optimizer")
        if name is None:
            return
        checks = {
            "lr": (lambda v: 0 < v <= 10, "Learning rate must be above 0 and at most 10"),
            "beta1": (lambda v: 0 <= v < 1, "beta1 must be in [0, 1)"),
            "beta2": (lambda v: 0 <= v < 1, "beta2 must be in [0, 1)"),
            "eps": (lambda v: 0 < v <= 1, "eps must be above 0 and at most 1"),
            "weight_decay": (lambda v: 0 <= v <= 1, "Weight decay must be in [0, 1]"),
            "momentum": (lambda v: 0 <= v < 1, "Momentum must be in [0, 1)"),
            "min_lr_ratio": (lambda v: 0 <= v <= 1, "Minimum LR ratio must be in [0, 1]"),
        }
        used = set(OPTIMIZER_FIELDS.get(name, ())) | {"min_lr_ratio"}
        for key in used:
            value = data.get(key)
            check, message = checks[key]
            if value is not None and not check(value):
                self.add_error(key, f"{message}, got {value:g}.")
        spec_fields = _spec_fields()
        schedule, warmup, max_steps = data.get("schedule"), data.get("warmup_steps"), data.get("max_steps")
        if not {"warmup_steps", "schedule"} <= spec_fields and (warmup or schedule == "cosine"):
            self.add_error("schedule", "This site's aggregators cannot schedule the learning rate yet; use constant.")
        if schedule == "cosine" and max_steps is None:
            self.add_error("schedule", "A cosine schedule decays until max steps: set max steps too.")
        if warmup and max_steps is not None and warmup >= max_steps:
            self.add_error("warmup_steps", f"Warmup steps ({warmup}) must be fewer than max steps ({max_steps}).")
        spec: dict[str, Any] = {"name": name}
        for key in (*used, "warmup_steps", "schedule"):
            if key in spec_fields and data.get(key) is not None:
                spec[key] = data[key]
        # validate_campaign sets total_steps (the end of a cosine) from max steps; editing max steps later keeps it.
        self.optimizer_spec = spec

    def _clean_together(self, data: dict[str, Any]) -> None:
        try:
            config, optimizer, count = validate_campaign(
                dataset=data["dataset"], architecture=data["architecture"], model_config=self.model_config,
                optimizer=self.optimizer_spec, target_batch_size=data["target_batch_size"],
                microbatch_size=data["microbatch_size"], codec=data["codec"], max_steps=data.get("max_steps"),
                num_aggregators=data["num_aggregators"],
            )
        except CampaignConfigError as exc:
            self.add_error(self._field_for(str(exc), data["architecture"]), str(exc))
            return
        self.model_config, self.optimizer_spec, self.param_count = config, optimizer, count

    @staticmethod
    def _field_for(message: str, architecture: str) -> str | None:
        if "sample length" in message:
            has_block = "block_size" in REGISTRY[architecture].fields
            return config_field_name(architecture, "block_size") if has_block else "dataset"
        if " trains on " in message:
            return "dataset"
        if message.startswith("optimizer.total_steps"):
            return "max_steps"
        if message.startswith("optimizer.name: LAMB"):
            return "num_aggregators"
        match = re.match(r"optimizer(?:\.|: OptimizerSpec\.)(\w+)", message)
        if match:
            return match.group(1) if match.group(1) in CampaignForm.base_fields else "optimizer"
        if message.startswith("optimizer"):
            return "optimizer"
        if "codec" in message:
            return "codec"
        if "batch size" in message:
            return "target_batch_size"
        return None

    # --------------------------------------------------------------- saving

    def save(self) -> Campaign:
        """Create the campaign (owned by the user) or update the instance, all or nothing."""
        data = self.cleaned_data
        with transaction.atomic():
            campaign = self.instance or Campaign(owner=self.user)
            for name in ("name", "description", "visibility", "max_steps", "target_val_loss"):
                setattr(campaign, name, data[name])
            if data.get("validate_every") is not None:  # left empty: the model's default
                campaign.validate_every = data["validate_every"]
            if not self.locked:
                campaign.dataset = data["dataset"]
                campaign.architecture = data["architecture"]
                campaign.model_config = self.model_config
                campaign.optimizer = self.optimizer_spec
                campaign.param_count = self.param_count
                for name in ("target_batch_size", "microbatch_size", "codec", "seed", "num_aggregators", "staleness",
                             "checkpoint_every"):  # fmt: skip
                    setattr(campaign, name, data[name])
            if campaign.visibility == Campaign.Visibility.INVITE and not campaign.invite_code:
                campaign.invite_code = new_invite_code()
            campaign.save()
        return campaign


class OrganizerRequestForm(forms.Form):
    reason = forms.CharField(
        max_length=2000, widget=forms.Textarea(attrs={"rows": 4}),
        label="What do you want to train?",
        help_text="A sentence or two for the admins: the model, the data, who you are.",
        error_messages={"required": "Say what you want to train, so an admin can decide.",
                        "max_length": "Keep the reason under %(limit_value)d characters."},  # fmt: skip
    )
