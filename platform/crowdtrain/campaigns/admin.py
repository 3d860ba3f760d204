from __future__ import annotations

from django.contrib import admin

from .models import Campaign, Dataset, Shard, Step


class ShardInline(admin.TabularInline):
    model = Shard
    extra = 0
    readonly_fields = ["index", "sha256", "first_sample", "num_samples", "size_bytes"]
    can_delete = False


@admin.register(Dataset)
class DatasetAdmin(admin.ModelAdmin):
    list_display = ["name", "kind", "num_samples", "size_bytes", "created_at"]
    inlines = [ShardInline]


@admin.register(Shard)
class ShardAdmin(admin.ModelAdmin):
    list_display = ["dataset", "index", "sha256", "num_samples", "size_bytes"]
    list_filter = ["dataset"]


@admin.register(Campaign)
class CampaignAdmin(admin.ModelAdmin):
    list_display = ["name", "owner", "architecture", "state", "committed_steps", "version", "epoch"]
    list_filter = ["state", "architecture"]
    readonly_fields = ["param_count", "committed_steps", "version", "epoch", "cursor"]


@admin.register(Step)
class StepAdmin(admin.ModelAdmin):
    list_display = ["campaign", "index", "num_samples", "loss", "committed_at", "applied_at"]
    list_filter = ["campaign"]
