"""The admin: staff may edit any campaign, within the bounds the campaign form and ``create_campaign`` enforce."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from crowdtrain_agent.fields import ConfigError
from crowdtrain_agent.models import REGISTRY

from .models import Campaign, OrganizerRequest, Step, ValidationResult
from .organizer_mail import mail_outcome
from .organizers import RoleRequestError, decide
from .settings_table import SETTINGS
from .setup import CampaignConfigError, validate_campaign


class CampaignAdminForm(forms.ModelForm):
    """Checks every setting as ``create_campaign`` does; the JSON of the model and optimizer is stored normalized."""

    class Meta:
        model = Campaign
        fields = "__all__"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for name in SETTINGS:
            if name in self.fields:  # the table's bounds, checked in clean, replace the columns' looser ones
                self.fields[name].validators = []

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        assert data is not None  # BaseModelForm.clean returns cleaned_data
        for name, setting in SETTINGS.items():
            if name in data and name not in self.errors:
                try:
                    data[name] = setting.spec.check(data[name], setting.describe(), field=name)
                except ConfigError as exc:
                    self.add_error(name, str(exc))
        needed = (
            "dataset",
            "architecture",
            "model_config",
            "optimizer",
            "target_batch_size",
            "microbatch_size",
            "codec",
            "num_aggregators",
        )
        if self.errors or any(name not in data for name in needed):
            return data
        try:
            config, optimizer, count = validate_campaign(data)
        except CampaignConfigError as exc:
            self.add_error(self._admin_field(exc.field, data.get("architecture")), str(exc))
            return data
        data["model_config"], data["optimizer"] = config, optimizer
        self.instance.param_count = count
        return data

    def _admin_field(self, field: str | None, architecture: str | None) -> str | None:
        # The campaign form's field names, mapped onto the admin's columns: a model config key is in
        # model_config, a hyperparameter or schedule field in the optimizer JSON.
        if field is None or field in self.fields:
            return field
        entry = REGISTRY.get(architecture or "")
        if "__" in field or (entry is not None and field in entry.fields):
            return "model_config"
        return "optimizer"


@admin.register(Campaign)
class CampaignAdmin(admin.ModelAdmin):
    form = CampaignAdminForm
    list_display = ["name", "owner", "architecture", "state", "committed_steps", "version", "epoch"]
    list_filter = ["state", "architecture"]
    readonly_fields = ["param_count", "committed_steps", "version", "epoch", "cursor", "invite_code"]
    filter_horizontal = ["invited"]


@admin.register(Step)
class StepAdmin(admin.ModelAdmin):
    list_display = ["campaign", "index", "num_samples", "loss", "committed_at", "applied_at"]
    list_filter = ["campaign"]


@admin.register(OrganizerRequest)
class OrganizerRequestAdmin(admin.ModelAdmin):
    """Grant or refuse from the list (also on the staff page /organizers/requests)."""

    list_display = ["user", "created", "decision", "decided_by", "decided_at"]
    list_filter = ["decision"]
    search_fields = ["user__email", "user__username", "reason"]
    readonly_fields = ["user", "reason", "created", "decision", "decided_by", "decided_at"]
    actions = ["grant", "refuse"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def _decide(self, request: HttpRequest, queryset: QuerySet[OrganizerRequest], *, grant: bool) -> None:
        for row in queryset:
            try:
                decided = decide(row.pk, request.user, grant=grant)
            except RoleRequestError as exc:
                self.message_user(request, str(exc), messages.WARNING)
            else:
                mail_outcome(decided, request.build_absolute_uri("/"))

    @admin.action(description="Grant the organizer role")
    def grant(self, request: HttpRequest, queryset: QuerySet[OrganizerRequest]) -> None:
        self._decide(request, queryset, grant=True)

    @admin.action(description="Refuse")
    def refuse(self, request: HttpRequest, queryset: QuerySet[OrganizerRequest]) -> None:
        self._decide(request, queryset, grant=False)


@admin.register(ValidationResult)
class ValidationResultAdmin(admin.ModelAdmin):
    list_display = ["campaign", "version", "loss", "num_samples", "weights", "computed_at"]
    list_filter = ["campaign"]
    readonly_fields = ["campaign", "version", "loss", "num_samples", "weights", "computed_at"]
