"""Standings and checks in the Django admin: read-only records; standings change only through clear and ban."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from . import quarantine
from .models import Answer, Check, Standing


class ReadOnlyAdmin(admin.ModelAdmin):
    """The verification code writes these rows; an edit by hand would skip the credit and lease side effects."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Standing)
class StandingAdmin(ReadOnlyAdmin):
    list_display = [
        "volunteer",
        "email",
        "state",
        "checks_passed",
        "checks_failed",
        "uploads_refused",
        "streak",
        "changed_at",
        "appealed_at",
        "reviewed_by",
    ]
    list_filter = ["state"]
    list_select_related = ["volunteer", "reviewed_by"]
    search_fields = ["volunteer__email"]
    ordering = ["-changed_at"]
    actions = ["clear", "ban"]

    @admin.display(description="e-mail", ordering="volunteer__email")
    def email(self, row: Standing) -> str:
        return row.volunteer.email

    @admin.action(description="Clear the selected volunteers (credit given back, work accepted)")
    def clear(self, request: HttpRequest, rows: QuerySet[Standing]) -> None:
        changed = [row.volunteer_id for row in rows if quarantine.clear(row.volunteer_id, request.user.pk)]
        self._report(request, "cleared", changed, len(rows))

    @admin.action(description="Ban the selected volunteers (devices revoked, credit stays taken back)")
    def ban(self, request: HttpRequest, rows: QuerySet[Standing]) -> None:
        changed = [
            row.volunteer_id
            for row in rows
            if quarantine.ban(row.volunteer_id, request.user.pk, "banned by an admin in the Django admin")
        ]
        self._report(request, "banned", changed, len(rows))

    def _report(self, request: HttpRequest, done: str, changed: list[int], selected: int) -> None:
        self.message_user(request, f"{len(changed)} of {selected} volunteers {done}.", messages.SUCCESS)
        if len(changed) < selected:
            self.message_user(
                request,
                f"{selected - len(changed)} were left as they were: only quarantined volunteers can be cleared, "
                "and a banned volunteer is banned already.",
                messages.WARNING,
            )


# The sketch is left out: hundreds of numbers nobody reads; the figures below summarise it.
ANSWER_FIELDS = ("lease_id", "role", "volunteer", "device", "verdict", "cosine", "norm_ratio", "reported_at")


class AnswerInline(admin.TabularInline):
    model = Answer
    fields = ANSWER_FIELDS
    readonly_fields = ANSWER_FIELDS
    extra = 0
    can_delete = False
    show_change_link = False

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Check)
class CheckAdmin(ReadOnlyAdmin):
    list_display = ["lease_id", "campaign", "volunteer", "state", "detail", "created_at", "decided_at", "credited"]
    list_filter = ["state", "campaign"]
    list_select_related = ["campaign", "volunteer"]
    search_fields = ["lease_id", "volunteer__email"]
    ordering = ["-created_at"]
    inlines = [AnswerInline]
