from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from .models import CreditEntry


@admin.register(CreditEntry)
class CreditEntryAdmin(admin.ModelAdmin):
    """Read-only: the ledger changes only by grants and reversals, so every total can be audited."""

    list_display = ["id", "created_at", "kind", "volunteer", "team", "campaign", "lease", "samples", "flops"]
    list_filter = ["kind", "campaign"]
    list_select_related = ["volunteer", "team", "campaign"]
    ordering = ["-created_at", "-id"]
    raw_id_fields = ["lease", "volunteer", "device", "team", "campaign"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
