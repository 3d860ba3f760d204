from __future__ import annotations

from django.contrib import admin

from .models import Aggregator, Lease, SliceAssignment


@admin.register(Lease)
class LeaseAdmin(admin.ModelAdmin):
    list_display = ["id", "campaign", "device", "base_version", "num_samples", "state", "step", "issued_at"]
    list_filter = ["state", "campaign"]


@admin.register(Aggregator)
class AggregatorAdmin(admin.ModelAdmin):
    list_display = ["name", "connected", "last_seen_at", "upload_url"]
    readonly_fields = ["token_hash"]


@admin.register(SliceAssignment)
class SliceAssignmentAdmin(admin.ModelAdmin):
    list_display = ["campaign", "index", "aggregator", "start", "end", "ready", "version"]
