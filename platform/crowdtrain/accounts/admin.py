from __future__ import annotations

from django.contrib import admin

from .models import Device


@admin.register(Device)
class DeviceAdmin(admin.ModelAdmin):
    list_display = ["name", "owner", "created_at", "last_seen_at", "revoked_at", "samples_accepted"]
    list_filter = ["revoked_at"]
    search_fields = ["name", "owner__username"]
    readonly_fields = ["token_hash", "hardware"]
