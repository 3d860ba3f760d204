"""Browser pages for devices: approving an agent's login code, the volunteer's own devices and their live feed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from crowdtrain.accounts import throttle
from crowdtrain.accounts.models import Device, DeviceAuthorization
from crowdtrain.accounts.users import signed_in_user
from crowdtrain.campaigns.visibility import open_campaigns

from . import actions, grant
from .status import owned_devices, status_rows

OPEN_CAMPAIGNS_SHOWN = 5  # on an empty My devices page; the home page lists them all


def _failures_key(request: HttpRequest) -> str:
    return f"user-code-failures.{request.user.pk}"


def _verify_form(request: HttpRequest, user_code: str = "", error: str = "", status: int = 200) -> HttpResponse:
    return render(request, "devices/verify.html", {"user_code": user_code, "error": error}, status=status)


def _confirm_page(request: HttpRequest, authorization: DeviceAuthorization, name: str, error: str = "") -> HttpResponse:
    context = {
        "authorization": authorization,
        "user_code": grant.format_user_code(authorization.user_code),
        "name": name,
        "hardware": actions.hardware_summary(authorization.hardware),
        "error": error,
    }
    return render(request, "devices/confirm.html", context, status=400 if error else 200)


def _lookup(request: HttpRequest, raw: str) -> DeviceAuthorization | HttpResponse:
    """The pending authorization for a typed code, or the form again saying what is wrong."""
    # User codes are short; every wrong guess counts, so nobody can try codes until one fits.
    if throttle.exceeded(_failures_key(request), settings.CROWDTRAIN_USER_CODE_FAILURES):
        return _verify_form(
            request, raw, "Too many codes that did not match. Wait ten minutes, then try again.", status=429
        )
    try:
        return grant.find_pending(raw)
    except grant.CodeProblem as exc:
        throttle.hit(_failures_key(request), settings.CROWDTRAIN_USER_CODE_FAILURES)
        return _verify_form(request, raw, str(exc), status=400)


@login_required
@require_http_methods(["GET", "POST"])
def verify(request: HttpRequest) -> HttpResponse:
    """The verification URI: type the code the agent printed (prefilled from ?user_code=), then confirm."""
    source = request.POST if request.method == "POST" else request.GET
    raw = source.get("user_code", "").strip()
    if not raw:
        return _verify_form(request)
    found = _lookup(request, raw)
    if isinstance(found, HttpResponse):
        return found
    # Even a prefilled link only shows the confirmation: a code someone sent you must not approve itself.
    return _confirm_page(request, found, found.requested_name)


@login_required
@require_POST
def confirm(request: HttpRequest) -> HttpResponse:
    decision = request.POST.get("decision")
    if decision not in ("approve", "deny"):
        return HttpResponseBadRequest("decision must be approve or deny")
    found = _lookup(request, request.POST.get("user_code", ""))
    if isinstance(found, HttpResponse):
        return found
    if decision == "deny":
        decided = grant.deny(found)
        name = found.requested_name
    else:
        try:
            name = actions.clean_device_name(request.POST.get("name"))
        except ValueError as exc:
            return _confirm_page(request, found, request.POST.get("name", "")[:200], str(exc))
        decided = grant.approve(found, signed_in_user(request), name)
    if not decided:  # decided or expired between the page and the click
        return _verify_form(request, "", "That code was used or expired meanwhile. Run crowdtrain-agent login again.")
    return render(request, "devices/decided.html", {"approved": decision == "approve", "name": name})


@dataclass(frozen=True)
class DeviceRow:
    device: Device
    status: dict[str, Any]  # what /devices/status says of it; devices-live.js keeps it current
    hardware: list[tuple[str, str]]


@login_required
@require_GET
def device_list(request: HttpRequest) -> HttpResponse:
    owned = owned_devices(signed_in_user(request))
    statuses = status_rows(owned)
    rows = [DeviceRow(d, statuses[d.pk], actions.hardware_summary(d.hardware)) for d in owned]
    # A volunteer with no device yet is one step from the way in: each open campaign's join page.
    campaigns = [] if rows else list(open_campaigns()[:OPEN_CAMPAIGNS_SHOWN])
    return render(
        request, "devices/list.html", {"rows": rows, "max_name": actions.MAX_NAME, "open_campaigns": campaigns}
    )


def _own_device(request: HttpRequest, device_id: int) -> Device:
    # Someone else's device is a 404, not a 403: its id says nothing about whether it exists.
    return get_object_or_404(Device, pk=device_id, owner=request.user)


@login_required
@require_POST
def rename(request: HttpRequest, device_id: int) -> HttpResponse:
    device = _own_device(request, device_id)
    try:
        name = actions.clean_device_name(request.POST.get("name"))
    except ValueError as exc:
        messages.error(request, f"{device.name} was not renamed: {exc}.")
        return redirect("devices")
    Device.objects.filter(pk=device.pk).update(name=name)
    messages.success(request, f"Renamed {device.name} to {name}.")
    return redirect("devices")


@login_required
@require_POST
def set_controls(request: HttpRequest, device_id: int) -> HttpResponse:
    """The volunteer's controls for one device; a connected agent takes them at once, another when it connects
    (its own flags win)."""
    device = _own_device(request, device_id)
    try:
        controls = actions.clean_controls(request.POST)
    except ValueError as exc:
        messages.error(request, f"The controls of {device.name} were not changed: {exc}.")
        return redirect("devices")
    actions.set_controls(device, controls)
    messages.success(
        request,
        f"Saved the controls of {device.name}; its agent takes them now if it is connected, or when it next "
        "connects (settings made on that machine itself come first).",
    )
    return redirect("devices")


@login_required
@require_POST
def revoke(request: HttpRequest, device_id: int) -> HttpResponse:
    device = _own_device(request, device_id)
    if actions.revoke(device, "revoked by its owner on the devices page"):
        messages.success(request, f"Revoked {device.name}: its agent was disconnected and its token no longer works.")
    else:
        messages.info(request, f"{device.name} was already revoked.")
    return redirect("devices")


@require_GET
def device_status(request: HttpRequest) -> JsonResponse:
    """``GET /devices/status``: the signed-in volunteer's devices, as ``devices-live.js`` polls them.

    JSON, not a login redirect, for a visitor who is not signed in: the script
    stops polling on 403 and says to sign in again.
    """
    if not request.user.is_authenticated:
        return JsonResponse({"error": "sign in to see your devices"}, status=403)
    rows = status_rows(owned_devices(signed_in_user(request)))
    response = JsonResponse({"devices": list(rows.values())})
    response["Cache-Control"] = "no-store"
    return response
