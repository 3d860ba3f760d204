from __future__ import annotations

from django.contrib import admin

from .models import Aggregator, Lease, Participation, ReturnedRange, SliceAssignment


@admin.register(Lease)
class LeaseAdmin(admin.ModelAdmin):
    list_display = ["id", "campaign", "device", "base_version", "num_samples", "state", "step", "issued_at"]
    list_filter = ["state", "campaign"]


@admin.register(ReturnedRange)
class ReturnedRangeAdmin(admin.ModelAdmin):
    list_display = ["campaign", "epoch", "shard_index", "start", "count"]


@admin.register(Aggregator)
class AggregatorAdmin(admin.ModelAdmin):
    list_display = ["name", "connected", "last_seen_at", "upload_url"]
    readonly_fields = ["token_hash"]


@admin.register(SliceAssignment)
class SliceAssignmentAdmin(admin.ModelAdmin):
    list_display = ["campaign", "index", "aggregator", "start", "end", "ready", "version"]


@admin.register(Participation)
class ParticipationAdmin(admin.ModelAdmin):
    list_display = ["campaign", "device", "last_request_at"]
