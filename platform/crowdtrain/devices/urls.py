"""Routes for devices: the agent's login API and the volunteer's device pages."""

from __future__ import annotations

from django.urls import path

from . import api, pages, tab_views

urlpatterns = [
    # the agent (RFC 8628 device login, then its bearer token)
    path("api/device/code", api.device_code, name="device-code"),
    path("api/device/token", api.device_token, name="device-token"),
    path("api/device/revoke", api.revoke, name="device-api-revoke"),
    path("api/me", api.me, name="api-me"),
    # the volunteer, logged in
    path("device", pages.verify, name="device-verify"),
    path("device/confirm", pages.confirm, name="device-confirm"),
    path("devices/", pages.device_list, name="devices"),
    path("devices/status", pages.device_status, name="devices-status"),
    path("devices/tab/", tab_views.create_tab_device, name="device-tab"),
    path("devices/<int:device_id>/rename", pages.rename, name="device-rename"),
    path("devices/<int:device_id>/controls", pages.set_controls, name="device-controls"),
    path("devices/<int:device_id>/revoke", pages.revoke, name="device-revoke"),
]
