"""Routes for devices: the agent's login API and the volunteer's device pages."""

from __future__ import annotations

from django.urls import path

from . import device_api, device_pages, device_status

urlpatterns = [
    # the agent (RFC 8628 device login, then its bearer token)
    path("api/device/code", device_api.device_code, name="device-code"),
    path("api/device/token", device_api.device_token, name="device-token"),
    path("api/device/revoke", device_api.revoke, name="device-api-revoke"),
    path("api/me", device_api.me, name="api-me"),
    # the volunteer, logged in
    path("device", device_pages.verify, name="device-verify"),
    path("device/confirm", device_pages.confirm, name="device-confirm"),
    path("devices/", device_pages.device_list, name="devices"),
    path("devices/status", device_status.device_status, name="devices-status"),
    path("devices/<int:device_id>/rename", device_pages.rename, name="device-rename"),
    path("devices/<int:device_id>/controls", device_pages.set_controls, name="device-controls"),
    path("devices/<int:device_id>/revoke", device_pages.revoke, name="device-revoke"),
]
