"""The organizer's campaign form, derived from the model registry, the optimizer registry and the settings table.

Every architecture's config fields are in the form (named ``<architecture>__<field>``),
and every optimizer's hyperparameters (named as in the optimizer registry); the
page shows the chosen architecture's and optimizer's, and only those are read.
Values are checked by the same code ``create_campaign`` runs, so the form and
every other way in accept the same campaigns, and each error carries the
field it belongs to.
"""

from __future__ import annotations

from typing import Any, TypeVar

from django import forms
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.db.models import QuerySet

from crowdtrain.accounts.models import new_invite_code
from crowdtrain.datasets.models import Dataset, Pretrained
from crowdtrain.datasets.permissions import visible_datasets
from crowdtrain_agent.fields import ConfigError, ConfigField
from crowdtrain_agent.models import REGISTRY, ModelConfigError
from crowdtrain_agent.optimizers import (
    DEFAULT_OPTIMIZER,
    HYPERPARAMETERS,
    OPTIMIZERS,
    SCHEDULE,
    OptimizerConfigError,
    setting_name,
    stored_value,
    wire_fields,
)

from .lifecycle import LOCK_REASON, config_locked
from .models import Campaign
from .settings_table import GROUPS, SETTINGS, Group, check_rules, locked_fields, rules_for_page
from .setup import CampaignConfigError, config_field_name, validate_campaign

ABOUT_FIELDS = ("name", "description", "visibility")
# The schedule fields an organizer sets; total_steps follows max steps (``validate_optimizer``).
SCHEDULE_FIELDS = ("warmup_steps", "schedule", "min_lr_ratio")
_F = TypeVar("_F", bound=forms.Field)

__all__ = ["CampaignForm", "OrganizerRequestForm", "config_field_name", "datasets_for"]


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


def spec_field(
    spec: ConfigField,
    label: str,
    *,
    required: bool,
    attrs: dict[str, str] | None = None,
    initial: Any = None,
    named: str = "",
) -> forms.Field:
    """The form field for a registry or settings-table spec.

    Bounds are not Django validators: ``clean`` checks them with the spec
    itself, so the message is the one ``create_campaign`` gives. The widget
    still carries them, for the browser's number input.
    """
    attrs = dict(attrs or {})
    named = named or label  # how error messages name the field
    help_text = spec.help
    if spec.kind in ("int", "float", "int_list"):  # a checkbox or a list of choices shows its own range
        help_text = f"{spec.help} ({spec.bounds_text()})" if spec.help else spec.bounds_text()
    initial = spec.default if initial is None else initial
    common: dict[str, Any] = {"label": label, "help_text": help_text, "required": required}
    if spec.kind == "bool":  # unticked is False, never missing
        common["required"] = False
        return forms.BooleanField(initial=initial, widget=forms.CheckboxInput(attrs=attrs), **common)
    if spec.kind == "choice":
        return forms.ChoiceField(
            choices=[(c, c) for c in spec.choices],
            initial=initial,
            error_messages=_messages(named),
            widget=forms.Select(attrs=attrs),
            **common,
        )
    if spec.kind == "int_list":
        return forms.CharField(
            initial=", ".join(str(v) for v in initial or ()),
            error_messages=_messages(named),
            widget=forms.TextInput(attrs=attrs),
            **{**common, "help_text": f"{help_text}; comma-separated"},
        )
    integer = spec.kind == "int"
    attrs.update(step="1" if integer else "any", min=_attr(spec.minimum), max=_attr(spec.maximum))
    field_class = forms.IntegerField if integer else forms.FloatField
    messages = _messages(named, invalid=f"{named}: enter a whole number.") if integer else _messages(named)
    return field_class(initial=initial, error_messages=messages, widget=forms.NumberInput(attrs=attrs), **common)


def _attr(bound: float) -> str:
    # An HTML number input's min/max: 1048576 rather than 1.04858e+06, 1e+30 rather than 31 digits.
    return str(int(bound)) if float(bound).is_integer() and abs(bound) < 1e15 else f"{bound:g}"


def readable_label(spec: Any, name: str) -> str:
    """A model setting's label for people, its config name kept for those who know it: "Transformer blocks
    (n_layer)", from the first clause of its help; the bare name when it has no help."""
    words = (spec.label or spec.help.split(";")[0]).strip()
    return f"{words[:1].upper()}{words[1:]} ({name})" if words else name


class DatasetChoiceField(forms.ModelChoiceField):
    def label_from_instance(self, obj: Dataset) -> str:
        # The sample length is what a text model's block_size must match (block_size + 1 bytes per sample).
        shape = f", {obj.sample_len}-byte samples" if obj.kind == Dataset.Kind.TEXT else ""
        return f"{obj.name} ({obj.kind}, {obj.num_samples} samples{shape})"


class PretrainedChoiceField(forms.ModelChoiceField):
    def label_from_instance(self, obj: Pretrained) -> str:
        return f"{obj.name} ({obj.architecture}, {obj.param_count:,} parameters)"


def pretrained_for(user: Any) -> QuerySet[Pretrained]:
    """Pretrained weights ``user`` may start a campaign from: their own (staff: any), converted."""
    weights = Pretrained.objects.filter(status=Pretrained.Status.READY)
    return (weights if user.is_staff else weights.filter(owner=user)).order_by("-created_at", "-id")


class CampaignForm(forms.Form):
    name = forms.CharField(max_length=200, error_messages=_messages("Name"))
    description = forms.CharField(
        required=False,
        max_length=5000,
        widget=forms.Textarea(attrs={"rows": 4}),
        help_text="What the model is for; volunteers see it on the join page.",
    )
    visibility = forms.ChoiceField(
        choices=Campaign.Visibility.choices,
        initial=Campaign.Visibility.PUBLIC,
        widget=forms.RadioSelect,
        error_messages=_messages("Visibility"),
    )
    dataset = DatasetChoiceField(
        queryset=Dataset.objects.none(),
        error_messages=_messages("Dataset"),
        help_text="One of your datasets that has finished splitting into shards.",
    )
    pretrained = PretrainedChoiceField(
        queryset=Pretrained.objects.none(),
        required=False,
        empty_label="none: the seeded random initialisation",
        label="Start from",
        help_text="Pretrained weights you uploaded: version 0 is them, and the architecture and its sizes are theirs.",
        error_messages=_messages("Start from"),
    )
    architecture = forms.ChoiceField(choices=[], error_messages=_messages("Architecture"))
    optimizer = forms.ChoiceField(choices=[], initial=DEFAULT_OPTIMIZER, error_messages=_messages("Optimizer"))

    def __init__(self, *args: Any, user: Any, instance: Campaign | None = None, **kwargs: Any) -> None:
        if instance is not None:
            kwargs.setdefault("initial", self._initial_from(instance))
        super().__init__(*args, **kwargs)
        self.user = user
        self.instance = instance
        self.locked = instance is not None and config_locked(instance)
        self.lock_reason = LOCK_REASON if self.locked else ""
        self.model_config: dict[str, Any] = {}
        self.optimizer_config: dict[str, Any] = {}
        self.optimizer_spec: dict[str, Any] = {}
        self.param_count = 0
        datasets = datasets_for(user)
        if instance is not None:  # keep the current dataset selectable even if it is not the user's own
            datasets = datasets | Dataset.objects.filter(pk=instance.dataset_id)
        self._declared("dataset", DatasetChoiceField).queryset = datasets
        weights = pretrained_for(user)
        if instance is not None and instance.pretrained_id:
            weights = weights | Pretrained.objects.filter(pk=instance.pretrained_id)
        self._declared("pretrained", PretrainedChoiceField).queryset = weights
        architectures = [(name, f"{name}: {e.description}") for name, e in REGISTRY.items()]
        self._declared("architecture", forms.ChoiceField).choices = architectures
        self._declared("optimizer", forms.ChoiceField).choices = [(name, e.label) for name, e in OPTIMIZERS.items()]
        self._add_registry_fields()
        self.order_fields(
            [
                *ABOUT_FIELDS,
                "dataset",
                "pretrained",
                "architecture",
                *(config_field_name(a, f) for a, e in REGISTRY.items() for f in e.fields),
                "optimizer",
                *HYPERPARAMETERS,
                *SCHEDULE_FIELDS,
                *SETTINGS,
            ]
        )
        if self.locked:
            for name, field in self.fields.items():
                if self._is_locked(name):
                    field.disabled = True
            total = (instance.optimizer or {}).get("total_steps") if instance else None
            if total:  # the aggregators hold the schedule: its length stays what it was at the start
                self.fields["max_steps"].help_text += f"; the learning-rate schedule still ends at step {total}"

    def _declared(self, name: str, kind: type[_F]) -> _F:
        """This form's copy of a field declared on the class, typed as declared."""
        field = self.fields[name]
        assert isinstance(field, kind), f"{name} is declared as a {kind.__name__}"
        return field

    def _add_registry_fields(self) -> None:
        taken = set(self.fields) | set(SETTINGS)
        for architecture, entry in REGISTRY.items():
            for name, spec in entry.fields.items():
                self.fields[config_field_name(architecture, name)] = spec_field(
                    spec,
                    readable_label(spec, name),
                    required=False,
                    attrs={"data-architecture": architecture},
                    named=f"{architecture}.{name}",
                )
        carried = wire_fields()
        for name, spec in {**HYPERPARAMETERS, **{k: SCHEDULE[k] for k in SCHEDULE_FIELDS}}.items():
            if name in taken:
                raise ImproperlyConfigured(f"optimizer hyperparameter {name!r} clashes with a campaign form field")
            field = spec_field(spec, spec.label or name, required=False)
            if name not in carried and "extra" not in carried:
                # Until the protocol carries it, it keeps its default: the aggregators could not receive another.
                field.disabled = True
                field.help_text += "; needs aggregators that speak a newer protocol"
            self.fields[name] = field
        for name, setting in SETTINGS.items():
            # Never required: left empty, an optional setting is unset, any other keeps its value (see clean).
            self.fields[name] = spec_field(setting.spec, setting.label, required=False, initial=setting.default)

    # --------------------------------------------------------------- layout helpers for the template

    def _is_locked(self, name: str) -> bool:
        if "__" in name:
            return True  # model config
        return name in ("optimizer", "pretrained", *HYPERPARAMETERS, *SCHEDULE_FIELDS) or name in locked_fields()

    def config_sets(self) -> list[tuple[str, str, list[forms.BoundField]]]:
        """(architecture, description, its bound config fields) for each registry entry."""
        return [
            (arch, entry.description, [self[config_field_name(arch, name)] for name in entry.fields])
            for arch, entry in REGISTRY.items()
        ]

    def hyperparameter_fields(self) -> list[forms.BoundField]:
        return [self[name] for name in HYPERPARAMETERS]

    def schedule_fields(self) -> list[forms.BoundField]:
        return [self[name] for name in SCHEDULE_FIELDS]

    def setting_groups(self) -> list[tuple[Group, list[forms.BoundField], bool]]:
        """(group, its bound fields, whether any has an error) in the table's order."""
        groups = []
        for key, group in GROUPS.items():
            fields = [self[name] for name, setting in SETTINGS.items() if setting.group == key]
            groups.append((group, fields, any(f.errors for f in fields)))
        return groups

    def pretrained_configs(self) -> dict[str, dict[str, Any]]:
        """{weights id: their architecture and config}: choosing weights fills the model's fields."""
        weights = self._declared("pretrained", PretrainedChoiceField).queryset
        assert weights is not None  # set in __init__
        return {
            str(p.pk): {"architecture": p.architecture, "config": p.model_config}
            for p in weights.only("pk", "architecture", "model_config")
        }

    def setting_rules(self) -> list[dict[str, Any]]:
        """The rules between settings (``settings_table.RULES``); the page's script follows them."""
        return rules_for_page()

    def optimizer_field_map(self) -> dict[str, list[str]]:
        """The hyperparameters each optimizer reads; the page shows only the chosen one's."""
        return {name: list(entry.hyperparameters) for name, entry in OPTIMIZERS.items()}

    @staticmethod
    def _initial_from(campaign: Campaign) -> dict[str, Any]:
        initial: dict[str, Any] = {name: getattr(campaign, name) for name in (*ABOUT_FIELDS, *SETTINGS)}
        initial["dataset"] = campaign.dataset_id
        initial["pretrained"] = campaign.pretrained_id
        initial["architecture"] = campaign.architecture
        optimizer = dict(campaign.optimizer or {})
        initial["optimizer"] = optimizer.get("name", DEFAULT_OPTIMIZER)
        for key in (*HYPERPARAMETERS, *SCHEDULE_FIELDS):
            value = stored_value(optimizer, key)
            if value is not None:
                initial[key] = value
        for name, value in (campaign.model_config or {}).items():
            initial[config_field_name(campaign.architecture, name)] = (
                ", ".join(str(v) for v in value) if isinstance(value, list) else value
            )
        return initial

    # --------------------------------------------------------------- validation

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        assert data is not None  # Form.clean returns cleaned_data
        self._drop_unused_errors(data)
        if self.instance is not None and self.instance.state != Campaign.State.DRAFT:
            self._clean_started(data)
        self._clean_settings(data)
        if self.locked:
            return data  # a started campaign may also lose its stop rule: its organizer finishes it by hand
        if data.get("max_steps") is None and data.get("target_val_loss") is None and "max_steps" not in self.errors:
            self.add_error("max_steps", "Set a stop rule: max steps, a target validation loss, or both.")
        self._clean_model_config(data)
        self._clean_optimizer(data)
        if not self.errors:
            self._clean_together(data)
        return data

    def _drop_unused_errors(self, data: dict[str, Any]) -> None:
        # Hidden fields of another architecture or optimizer are not read, so their values cannot be wrong.
        architecture = data.get("architecture") or self.data.get("architecture")
        chosen = OPTIMIZERS.get(data.get("optimizer") or "")
        for key in list(self.errors):  # the ErrorDict full_clean is filling (no second clean)
            other_arch = "__" in key and not key.startswith(f"{architecture}__")
            unused_hyper = key in HYPERPARAMETERS and chosen is not None and key not in chosen.hyperparameters
            if other_arch or unused_hyper:
                del self.errors[key]

    def _clean_started(self, data: dict[str, Any]) -> None:
        # Validation stops before validate_campaign once started, but the rules between settings still hold.
        stored = {name: getattr(self.instance, name) for name in SETTINGS}
        # Left empty, a setting keeps its stored value (``_clean_settings``).
        rule_values = {**stored, **{name: data[name] for name in SETTINGS if data.get(name) is not None}}
        try:
            check_rules(rule_values, error=CampaignConfigError)
        except CampaignConfigError as exc:
            self.add_error(exc.field, str(exc))
        done = self.instance.committed_steps if self.instance else 0
        max_steps = data.get("max_steps")
        if max_steps is not None and max_steps <= done:
            self.add_error("max_steps", f"Max steps must be more than the {done} steps already made.")

    def _clean_settings(self, data: dict[str, Any]) -> None:
        # The table's bounds, as create_campaign checks them (disabled fields keep the stored values).
        for name, setting in SETTINGS.items():
            if name not in data or name in self.errors or self.fields[name].disabled:
                continue
            if data[name] in (None, "") and not setting.spec.optional:
                # Left empty: the campaign's current value, or the default for a new one.
                data[name] = getattr(self.instance, name) if self.instance is not None else setting.default
            try:
                data[name] = setting.spec.check(data[name], setting.describe(), field=name)
            except ConfigError as exc:
                self.add_error(name, str(exc))

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
            field = config_field_name(architecture, exc.field) if exc.field in entry.fields else "architecture"
            self.add_error(field, str(exc))

    def _clean_optimizer(self, data: dict[str, Any]) -> None:
        # Each of the chosen optimizer's fields is checked on its own, so every bad one shows at once;
        # validate_campaign then checks them together (the schedule against max steps...).
        entry = OPTIMIZERS.get(data.get("optimizer") or "")
        if entry is None:
            return
        config: dict[str, Any] = {"name": entry.name}
        for name in (*entry.hyperparameters, *SCHEDULE_FIELDS):
            value = data.get(name)
            if value in (None, "") or name in self.errors or self.fields[name].disabled:
                continue  # left empty: the registry's default
            spec = entry.hyperparameters.get(name) or SCHEDULE[name]
            try:
                config[name] = spec.check(value, setting_name(name), field=name, error=OptimizerConfigError)
            except OptimizerConfigError as exc:
                self.add_error(name, str(exc))
        # validate_campaign sets total_steps (the end of a cosine) from max steps; editing max steps later keeps it.
        self.optimizer_config = config

    def _clean_together(self, data: dict[str, Any]) -> None:
        try:
            config, optimizer, count = validate_campaign(
                {**data, "model_config": self.model_config, "optimizer": self.optimizer_config}
            )
        except CampaignConfigError as exc:
            self.add_error(exc.field if exc.field in self.fields else None, str(exc))
            return
        self.model_config, self.optimizer_spec, self.param_count = config, optimizer, count

    # --------------------------------------------------------------- saving

    def save(self) -> Campaign:
        """Create the campaign (owned by the user) or update the instance, all or nothing."""
        data = self.cleaned_data
        with transaction.atomic():
            campaign = self.instance or Campaign(owner=self.user)
            for name in ABOUT_FIELDS:
                setattr(campaign, name, data[name])
            for name, setting in SETTINGS.items():
                if not (self.locked and setting.locks):
                    setattr(campaign, name, data[name])
            if not self.locked:
                campaign.dataset = data["dataset"]
                campaign.pretrained = data.get("pretrained")
                campaign.architecture = data["architecture"]
                campaign.model_config = self.model_config
                campaign.optimizer = self.optimizer_spec
                campaign.param_count = self.param_count
            if campaign.visibility == Campaign.Visibility.INVITE and not campaign.invite_code:
                campaign.invite_code = new_invite_code()
            campaign.save()
        return campaign


class OrganizerRequestForm(forms.Form):
    reason = forms.CharField(
        max_length=2000,
        widget=forms.Textarea(attrs={"rows": 4}),
        label="What do you want to train?",
        help_text="A sentence or two for the admins: the model, the data, who you are.",
        error_messages={
            "required": "Say what you want to train, so an admin can decide.",
            "max_length": "Keep the reason under %(limit_value)d characters.",
        },
    )
