"""The admin of browser graphs: read-only, since only a check writes them (`check_browser_graphs --again`)."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from .models import BrowserGraph


@admin.register(BrowserGraph)
class BrowserGraphAdmin(admin.ModelAdmin):
    list_display = [
        "model_name",
        "microbatch_size",
        "status",
        "ratio",
        "bytes",
        "wide_size",
        "memory_bytes",
        "checked_at",
    ]
    list_filter = ["status", "model_name"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
