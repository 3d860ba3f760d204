from __future__ import annotations

from django.contrib import admin

from .models import Device, DeviceAuthorization, Profile, Team


@admin.register(Device)
class DeviceAdmin(admin.ModelAdmin):
    list_display = ["name", "owner", "created_at", "last_seen_at", "revoked_at", "samples_accepted"]
    list_filter = ["revoked_at"]
    search_fields = ["name", "owner__username"]
    readonly_fields = ["token_hash", "hardware"]


class MemberInline(admin.TabularInline):
    model = Profile
    fields = ["user", "display_name", "anonymous"]
    readonly_fields = ["user"]
    extra = 0
    can_delete = False
    verbose_name_plural = "members"


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin):
    list_display = ["name", "slug", "created_by", "created_at"]
    search_fields = ["name", "slug"]
    readonly_fields = ["slug", "invite_code", "created_at"]
    inlines = [MemberInline]


@admin.register(Profile)
class ProfileAdmin(admin.ModelAdmin):
    list_display = ["user", "display_name", "anonymous", "team"]
    list_filter = ["anonymous"]
    search_fields = ["display_name", "user__email", "user__username"]
    autocomplete_fields = ["team"]


@admin.register(DeviceAuthorization)
class DeviceAuthorizationAdmin(admin.ModelAdmin):
    """Read-only: codes are approved in the volunteer's browser, never by an admin on their behalf."""

    list_display = [
        "user_code",
        "requested_name",
        "created_at",
        "expires_at",
        "approved_by",
        "denied_at",
        "consumed_at",
    ]
    list_filter = ["denied_at", "consumed_at"]
    search_fields = ["user_code", "requested_name", "approved_by__email"]

    def has_add_permission(self, request: object) -> bool:
        return False

    def has_change_permission(self, request: object, obj: object = None) -> bool:
        return False
