"""``POST /devices/tab/``: a browser tab becomes one of its volunteer's devices, with a token of its own.

A tab computes as a device (kind "browser", protocol 2.10) so everything a
device has applies to it unchanged: leases, verification, credit, My devices,
revocation. Its volunteer is logged in already, so no device-code login: the
page asks here once, keeps the token in localStorage, and asks again only
when the site closes its socket with 4001 (unknown token) or 4003 (revoked).
The token is shown once and stored hashed, as every device token is.
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any

import msgspec
from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.middleware.csrf import CsrfViewMiddleware
from django.views.decorators.csrf import csrf_exempt

from crowdtrain.accounts import throttle
from crowdtrain.accounts.models import Device
from crowdtrain.accounts.users import signed_in_user
from crowdtrain.campaigns.models import Campaign
from crowdtrain.campaigns.visibility import can_watch
from crowdtrain.lib import jsonbodies

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 1024  # {"campaign_id": 123}; anything larger is not from the page
MAX_USER_AGENT_CHARS = 512  # read of the User-Agent header; real ones are under 300


class TabRequest(msgspec.Struct):
    """The body the tab page sends: the campaign it is about to compute for, checked before a token is made."""

    campaign_id: Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)] | None = None


# Most specific first: Edge and Opera say "Chrome/" too, Chrome says "Safari/", Chromium may say "Chrome/" only.
_BROWSERS = [
    ("Edg/", "Edge"),
    ("OPR/", "Opera"),
    ("Firefox/", "Firefox"),
    ("Chromium/", "Chromium"),
    ("Chrome/", "Chrome"),
    ("Safari/", "Safari"),
]
_SYSTEMS = [
    ("Android", "Android"),
    ("iPhone", "iOS"),
    ("iPad", "iPadOS"),
    ("CrOS", "ChromeOS"),
    ("Windows", "Windows"),
    ("Mac OS X", "macOS"),
    ("Macintosh", "macOS"),
    ("Linux", "Linux"),
]


def tab_device_name(user_agent: str) -> str:
    """A name My devices shows for a tab, like "Chromium tab on Linux", from the browser's User-Agent.

    Only words from the lists above reach the name, never the header's own
    text: a stranger's header cannot put anything on a page, and the name
    always fits ``Device.name``.
    """
    agent = user_agent[:MAX_USER_AGENT_CHARS]
    browser = next((name for marker, name in _BROWSERS if marker in agent), "Browser")
    system = next((name for marker, name in _SYSTEMS if marker in agent), "")
    return f"{browser} tab on {system}" if system else f"{browser} tab"


def _error(message: str, status: int, **headers: str) -> JsonResponse:
    response = JsonResponse({"error": message}, status=status)
    response["Cache-Control"] = "no-store"
    for name, value in headers.items():
        response[name.replace("_", "-")] = value
    return response


def _not_called(_: HttpRequest) -> HttpResponse:
    """The view and next handler ``CsrfViewMiddleware`` wants to be given; its check calls neither."""
    raise AssertionError("the CSRF check called the view it was only meant to check")


def _csrf_refusal(request: HttpRequest) -> JsonResponse | None:
    """Django's CSRF check, answered in JSON a page's script can show (the middleware's own answer is a page)."""
    refused = CsrfViewMiddleware(_not_called).process_view(request, _not_called, (), {})
    if refused is None:
        return None
    return _error(
        "the request lacks a valid CSRF token: send the csrftoken cookie's value in the X-CSRFToken header "
        "(reload the page if the cookie is missing)",
        403,
    )


def _body(request: HttpRequest) -> TabRequest:
    """The request's JSON body as a ``TabRequest``; an empty body asks for no campaign in particular.

    Raises:
        jsonbodies.BodyError: saying what is wrong, in words for the page.
    """
    if len(request.body) > MAX_BODY_BYTES:
        raise jsonbodies.BodyError(f'the body is over {MAX_BODY_BYTES} bytes; send {{"campaign_id": <id>}} or nothing')
    if not request.body.strip():
        return TabRequest()
    if request.content_type != "application/json":
        raise jsonbodies.BodyError(f"send the body as application/json, not {request.content_type or 'untyped'}")
    try:
        data: Any = json.loads(request.body)
    except (ValueError, RecursionError):
        raise jsonbodies.BodyError('the body is not valid JSON; send {"campaign_id": <id>} or nothing') from None
    if not isinstance(data, dict):
        raise jsonbodies.BodyError('the body must be a JSON object, such as {"campaign_id": 3}')
    unknown = sorted(str(key) for key in data if key != "campaign_id")
    if unknown:
        raise jsonbodies.BodyError(f"unknown field {unknown[0][:40]!r}; the body takes only campaign_id")
    return jsonbodies.convert(data, TabRequest)


def _campaign_refusal(user: Any, campaign_id: int) -> JsonResponse | None:
    """Why this tab may not join ``campaign_id``, or None: the page hears it before any device is made."""
    campaign = Campaign.objects.filter(pk=campaign_id).exclude(state=Campaign.State.DRAFT).first()
    if campaign is None or not can_watch(user, campaign):  # invite-only ones say nothing to strangers
        return _error(f"there is no campaign {campaign_id} you may join; pick one from the home page", 404)
    if campaign.state in (Campaign.State.FINISHED, Campaign.State.ARCHIVED):
        return _error(f"campaign {campaign_id} has finished; it takes no more work, from a tab or an agent", 403)
    return None


@csrf_exempt  # checked below, after the login, so a page's script gets JSON either way
def create_tab_device(request: HttpRequest) -> JsonResponse:
    """``POST /devices/tab/`` -> 201 ``{"device_id", "token", "name"}``: a new device for this browser tab.

    Logged-in session and CSRF header (``X-CSRFToken``) required; an optional
    JSON body ``{"campaign_id": int}`` is checked first. Each volunteer may make
    ``CROWDTRAIN_TAB_DEVICES_PER_USER`` tab devices per 10 minutes, and each
    address counts against ``CROWDTRAIN_DEVICE_CODES_PER_IP`` as the agent's
    logins do, so a script cannot mint thousands of devices.
    """
    if request.method != "POST":
        return _error("POST to this address to add this browser tab as one of your devices", 405, Allow="POST")
    if not request.user.is_authenticated:
        return _error("log in first: a tab computes as one of your devices", 401)
    if refused := _csrf_refusal(request):
        return refused
    try:
        body = _body(request)
    except jsonbodies.BodyError as exc:
        return _error(str(exc), 400)
    user = signed_in_user(request)
    if body.campaign_id is not None and (refused := _campaign_refusal(user, body.campaign_id)):
        return refused
    per_user = throttle.hit(f"tab-devices.{user.pk}", settings.CROWDTRAIN_TAB_DEVICES_PER_USER)
    per_address = throttle.hit(f"device-code.{throttle.client_ip(request)}", settings.CROWDTRAIN_DEVICE_CODES_PER_IP)
    if per_user or per_address:
        return _error(
            "too many devices made for browser tabs lately; wait 10 minutes, or reuse a tab you opened before "
            "(each keeps its token), or revoke old tabs on My devices",
            429,
            Retry_After=str(throttle.WINDOW_S),
        )
    name = tab_device_name(request.headers.get("User-Agent", ""))
    device, token = Device.issue(user, name)
    # Shown as a browser tab on My devices before its first hello, which then says more (runtime, speed).
    Device.objects.filter(pk=device.pk).update(hardware={"kind": "browser", "name": name})
    logger.info("device %s of %s made for a browser tab", device.pk, user.pk)
    response = JsonResponse({"device_id": device.pk, "token": token, "name": name}, status=201)
    response["Cache-Control"] = "no-store"  # it carries a credential
    return response
