"""JSON endpoints for the agent: device-code login (RFC 8628), who am I, and log out."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlencode

import msgspec
from django.conf import settings
from django.http import HttpRequest, JsonResponse
from django.urls import reverse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from crowdtrain.accounts import throttle
from crowdtrain.accounts.models import Device
from crowdtrain.accounts.names import account_name
from crowdtrain.accounts.tokens import bearer_token
from crowdtrain.lib import jsonbodies
from crowdtrain.lib.text import not_text

from . import actions, grant

# Errors follow RFC 6749 §5.2: {"error": code, "error_description": text}. Nothing here
# reads a session cookie (the login endpoints need no credentials, the others only the
# device's bearer token), so CSRF protection has nothing to protect and is off.

MAX_BODY_BYTES = 8192  # a name and a small hardware report; larger is a mistake or an attack
CLIENT_ID = "crowdtrain-agent"  # the one public client (RFC 6749 §2.1); optional in requests


class _BadRequest(Exception):
    def __init__(self, description: str, status: int = 400) -> None:
        super().__init__(description)
        self.status = status


def _oauth_error(error: str, description: str, status: int = 400, **headers: str) -> JsonResponse:
    response = JsonResponse({"error": error, "error_description": description}, status=status)
    response["Cache-Control"] = "no-store"
    for name, value in headers.items():
        response[name.replace("_", "-")] = value
    return response


def _ok(data: dict[str, Any]) -> JsonResponse:
    response = JsonResponse(data)
    response["Cache-Control"] = "no-store"  # RFC 6749 §5.1: responses carrying credentials
    return response


class DeviceParams(msgspec.Struct):
    """The login endpoints' parameters, alike from a form (RFC 8628) or a JSON body; others are ignored."""

    client_id: str | None = None
    grant_type: str | None = None  # the token endpoint's
    device_code: str | None = None  # the token endpoint's
    name: str | None = None  # the code endpoint's: the device's proposed name
    hardware: dict[str, Any] | str | None = None  # the code endpoint's: an object, or its JSON text in a form


def _params(request: HttpRequest) -> DeviceParams:
    """The request's parameters from a form-encoded (as the RFC says) or a JSON body, size-capped."""
    try:
        declared = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        raise _BadRequest("bad Content-Length") from None
    if declared > MAX_BODY_BYTES or len(request.body) > MAX_BODY_BYTES:
        raise _BadRequest(f"request body over {MAX_BODY_BYTES} bytes", status=413)
    if request.content_type == "application/json":
        try:
            data = json.loads(request.body or b"{}")
        except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser goes
            raise _BadRequest("the body is not valid JSON") from None
        if not isinstance(data, dict):
            raise _BadRequest("the body must be a JSON object")
        bad = next(not_text(data), None)
        if bad is not None:
            raise _BadRequest(f"{bad} is not text (it holds a lone surrogate); send UTF-8 strings")
    else:
        repeated = [key for key, values in request.POST.lists() if len(values) > 1]
        if repeated:  # RFC 6749 §3.2: parameters must not be included more than once
            raise _BadRequest(f"parameter {repeated[0]!r} given more than once")
        data = request.POST.dict()
    try:
        return jsonbodies.convert(data, DeviceParams)
    except jsonbodies.BodyError as exc:
        raise _BadRequest(str(exc)) from None


def _check_client(params: DeviceParams) -> JsonResponse | None:
    if params.client_id is not None and params.client_id != CLIENT_ID:
        return _oauth_error("invalid_client", f"unknown client_id; use {CLIENT_ID!r}", status=401)
    return None


def _client_params(request: HttpRequest) -> DeviceParams | JsonResponse:
    """The request's parameters, or the OAuth error that refuses it (bad body, unknown client)."""
    try:
        params = _params(request)
    except _BadRequest as exc:
        return _oauth_error("invalid_request", str(exc), status=exc.status)
    refused = _check_client(params)
    return params if refused is None else refused


@csrf_exempt
@require_POST
def device_code(request: HttpRequest) -> JsonResponse:
    """RFC 8628 §3.1-3.2: a fresh device code and user code."""
    params = _client_params(request)
    if isinstance(params, JsonResponse):
        return params
    if throttle.hit(f"device-code.{throttle.client_ip(request)}", settings.CROWDTRAIN_DEVICE_CODES_PER_IP):
        return _oauth_error(
            "slow_down",
            "too many login codes asked for from this address; try again in 10 minutes",
            status=429,
            Retry_After=str(throttle.WINDOW_S),
        )
    try:
        authorization, code = grant.start(params.name, params.hardware)
    except ValueError as exc:
        return _oauth_error("invalid_request", str(exc))
    user_code = grant.format_user_code(authorization.user_code)
    verification_uri = request.build_absolute_uri(reverse("device-verify"))
    return _ok(
        {
            "device_code": code,
            "user_code": user_code,
            "verification_uri": verification_uri,
            "verification_uri_complete": f"{verification_uri}?{urlencode({'user_code': user_code})}",
            "expires_in": settings.CROWDTRAIN_DEVICE_CODE_TTL_S,
            "interval": authorization.interval,
        }
    )


@csrf_exempt
@require_POST
def device_token(request: HttpRequest) -> JsonResponse:
    """RFC 8628 §3.4-3.5: poll with the device code; the token once a volunteer approved."""
    params = _client_params(request)
    if isinstance(params, JsonResponse):
        return params
    grant_type = params.grant_type
    if grant_type is None:
        return _oauth_error("invalid_request", f"missing grant_type; use {grant.GRANT_TYPE}")
    if grant_type != grant.GRANT_TYPE:
        return _oauth_error("unsupported_grant_type", f"only {grant.GRANT_TYPE} is supported")
    code = params.device_code
    if not code:
        return _oauth_error("invalid_request", "missing device_code")
    try:
        device, token = grant.redeem(code)
    except grant.GrantError as exc:
        return _oauth_error(exc.error, exc.description)
    return _ok(
        {
            "access_token": token,
            "token_type": "Bearer",
            "device_id": device.pk,
            "device_name": device.name,
            "user": account_name(device.owner),
        }
    )


def _agent(request: HttpRequest) -> Device | None:
    device = Device.authenticate(bearer_token(dict(request.headers)))
    return None if device is None or device.is_revoked else device


def _unauthorized() -> JsonResponse:
    response = JsonResponse({"error": "invalid or revoked device token"}, status=401)
    response["WWW-Authenticate"] = 'Bearer error="invalid_token"'
    return response


@require_GET
def me(request: HttpRequest) -> JsonResponse:
    """Who this device token belongs to (``crowdtrain-agent whoami``)."""
    device = _agent(request)
    if device is None:
        return _unauthorized()
    return _ok(
        {
            "device_id": device.pk,
            "device_name": device.name,
            "user": account_name(device.owner),
            "server": request.build_absolute_uri("/").rstrip("/"),
        }
    )


@csrf_exempt
@require_POST
def revoke(request: HttpRequest) -> JsonResponse:
    """Revoke the calling device's own token (``crowdtrain-agent logout``) and close its sockets."""
    device = _agent(request)
    if device is None:
        return _unauthorized()
    actions.revoke(device, "logged out with crowdtrain-agent logout")
    return _ok({"revoked": True, "device_id": device.pk})
