"""The admin of datasets, their shards and uploads: read-mostly, since sharding writes them."""

from __future__ import annotations

from django.contrib import admin

from .models import Dataset, Shard, Upload


class ShardInline(admin.TabularInline):
    model = Shard
    extra = 0
    readonly_fields = ["split", "index", "sha256", "first_sample", "num_samples", "size_bytes"]
    can_delete = False


@admin.register(Dataset)
class DatasetAdmin(admin.ModelAdmin):
    list_display = [
        "name",
        "owner",
        "kind",
        "status",
        "num_samples",
        "num_validation_samples",
        "size_bytes",
        "created_at",
    ]
    list_filter = ["status", "kind"]
    readonly_fields = ["status", "progress", "error", "source_sha256"]
    inlines = [ShardInline]


@admin.register(Shard)
class ShardAdmin(admin.ModelAdmin):
    list_display = ["dataset", "split", "index", "sha256", "num_samples", "size_bytes"]
    list_filter = ["split", "dataset"]


@admin.register(Upload)
class UploadAdmin(admin.ModelAdmin):
    list_display = ["filename", "owner", "format", "size", "received", "state", "dataset", "created_at"]
    list_filter = ["state", "format"]
    readonly_fields = ["owner", "filename", "size", "sha256", "received", "state", "dataset"]
