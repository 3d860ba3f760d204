from __future__ import annotations

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from .models import Campaign, Dataset, OrganizerRequest, Shard, Step, Upload, ValidationResult
from .organizers import RoleRequestError, decide


class ShardInline(admin.TabularInline):
    model = Shard
    extra = 0
    readonly_fields = ["split", "index", "sha256", "first_sample", "num_samples", "size_bytes"]
    can_delete = False


@admin.register(Dataset)
class DatasetAdmin(admin.ModelAdmin):
    list_display = ["name", "owner", "kind", "status", "num_samples", "num_validation_samples", "size_bytes", "created_at"]
    list_filter = ["status", "kind"]
    readonly_fields = ["status", "progress", "error", "source_sha256"]
    inlines = [ShardInline]


@admin.register(Shard)
class ShardAdmin(admin.ModelAdmin):
    list_display = ["dataset", "split", "index", "sha256", "num_samples", "size_bytes"]
    list_filter = ["split", "dataset"]


@admin.register(Campaign)
class CampaignAdmin(admin.ModelAdmin):
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
                decide(row.pk, request.user, grant=grant)
            except RoleRequestError as exc:
                self.message_user(request, str(exc), messages.WARNING)

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


@admin.register(Upload)
class UploadAdmin(admin.ModelAdmin):
    list_display = ["filename", "owner", "format", "size", "received", "state", "dataset", "created_at"]
    list_filter = ["state", "format"]
    readonly_fields = ["owner", "filename", "size", "sha256", "received", "state", "dataset"]

