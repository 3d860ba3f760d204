"""The device authorization grant (RFC 8628), issuing our own per-device tokens."""

from __future__ import annotations

import json
import logging
import re
import secrets
import sys
from datetime import datetime, timedelta
from typing import Annotated, Any

import msgspec
from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.db.models import QuerySet
from django.utils import timezone

from crowdtrain.accounts.models import Device, DeviceAuthorization
from crowdtrain.accounts.tokens import hash_token
from crowdtrain.lib import jsonbodies

from .actions import clean_device_name

logger = logging.getLogger(__name__)

# `crowdtrain-agent login` asks for a code pair (start), shows the short user code,
# and polls with the secret device code (redeem) while the volunteer approves or
# denies it in the browser (find_pending, approve, deny). Approval creates nothing;
# the first poll that finds it creates the Device, owned by the approver, and gets
# its token, exactly once. Hand-written rather than django-oauth-toolkit's grant:
# that would issue OAuth access tokens, while the gateway, the scheduler and shard
# downloads all authenticate Device's hashed per-device token.

GRANT_TYPE = "urn:ietf:params:oauth:grant-type:device_code"
# No vowels (no words by accident), no digits (no 0/O, 1/I): RFC 8628 §6.1.
USER_CODE_ALPHABET = "BCDFGHJKLMNPQRSTVWXZ"
USER_CODE_LENGTH = 8
_USER_CODE = re.compile(f"^[{USER_CODE_ALPHABET}]{{{USER_CODE_LENGTH}}}$")
SLOW_DOWN_STEP_S = 5  # RFC 8628 §3.5: each slow_down adds 5 seconds to the interval
KEEP_SPENT_FOR = timedelta(days=1)  # decided and expired rows are deleted this long after expiry

# What an agent may report about its machine at login: a flat, small JSON object.
MAX_HARDWARE_BYTES = 4096
MAX_HARDWARE_KEYS = 32
MAX_HARDWARE_TEXT = 200
HardwareValue = (
    Annotated[str, msgspec.Meta(max_length=MAX_HARDWARE_TEXT)]
    | bool
    | Annotated[int, msgspec.Meta(ge=-(2**63) + 1, le=2**63 - 1)]  # a signed 64-bit column's range
    | Annotated[float, msgspec.Meta(ge=-sys.float_info.max, le=sys.float_info.max)]  # finite: no inf, no NaN
    | None
)
Hardware = Annotated[
    dict[Annotated[str, msgspec.Meta(pattern=r"^[a-z][a-z0-9_]{0,63}$")], HardwareValue],
    msgspec.Meta(max_length=MAX_HARDWARE_KEYS),
]


class GrantError(Exception):
    """An RFC 6749 §5.2 / RFC 8628 §3.5 error: ``error`` is the code, the message its description."""

    def __init__(self, error: str, description: str) -> None:
        super().__init__(description)
        self.error = error
        self.description = description


class CodeProblem(Exception):
    """A user code typed in the browser that cannot be approved; the message tells the volunteer why."""


def new_user_code() -> str:
    return "".join(secrets.choice(USER_CODE_ALPHABET) for _ in range(USER_CODE_LENGTH))


def normalize_user_code(raw: str) -> str | None:
    """``wdjb mjht`` or ``WDJB-MJHT`` → ``WDJBMJHT``; None if it cannot be a user code."""
    code = re.sub(r"[\s-]", "", str(raw)).upper()
    return code if _USER_CODE.match(code) else None


def format_user_code(code: str) -> str:
    half = len(code) // 2
    return f"{code[:half]}-{code[half:]}"


def clean_hardware(raw: Any) -> dict[str, Any]:
    """The hardware object an agent sent (a dict, or its JSON text in a form field), checked and bounded.

    Raises:
        ValueError: naming the offending key or limit.
    """
    if raw is None or raw == "":
        return {}
    if isinstance(raw, str):
        if len(raw) > MAX_HARDWARE_BYTES:
            raise ValueError(f"hardware is {len(raw)} bytes of JSON; at most {MAX_HARDWARE_BYTES}")
        try:
            raw = json.loads(raw)
        except (ValueError, RecursionError):
            raise ValueError("hardware is not valid JSON") from None
    try:
        cleaned = jsonbodies.convert(raw, Hardware, field="hardware")
    except jsonbodies.BodyError as exc:
        # msgspec says "a value" without its key; the key is what the agent's author needs to find.
        for key, value in raw.items() if isinstance(raw, dict) else ():
            jsonbodies.convert(value, HardwareValue, field=f"hardware.{key}")
        raise ValueError(str(exc)) from None
    for key, value in cleaned.items():
        if isinstance(value, str) and not value.isprintable():
            raise ValueError(f"hardware.{key} must be printable text of at most {MAX_HARDWARE_TEXT} characters")
    if len(json.dumps(cleaned)) > MAX_HARDWARE_BYTES:
        raise ValueError(f"hardware is over {MAX_HARDWARE_BYTES} bytes of JSON")
    return cleaned


def start(requested_name: Any, hardware: Any) -> tuple[DeviceAuthorization, str]:
    """Open a device authorization; returns it with its device code, which is never stored in clear.

    Raises:
        ValueError: if the proposed name or the hardware report is unacceptable.
    """
    name = clean_device_name(requested_name or "unnamed device")
    hardware = clean_hardware(hardware)
    now = timezone.now()
    DeviceAuthorization.objects.filter(expires_at__lt=now - KEEP_SPENT_FOR).delete()
    # 20^8 codes and a handful live at once: a clash is rare, and retried.
    live = DeviceAuthorization.objects.filter(expires_at__gt=now)
    user_code = new_user_code()
    while live.filter(user_code=user_code).exists():
        user_code = new_user_code()
    device_code = secrets.token_urlsafe(32)
    authorization = DeviceAuthorization.objects.create(
        device_code_hash=hash_token(device_code),
        user_code=user_code,
        requested_name=name,
        hardware=hardware,
        created_at=now,
        expires_at=now + timedelta(seconds=settings.CROWDTRAIN_DEVICE_CODE_TTL_S),
        interval=settings.CROWDTRAIN_DEVICE_CODE_INTERVAL_S,
    )
    return authorization, device_code


def redeem(device_code: str, now: datetime | None = None) -> tuple[Device, str]:
    """One poll of the token endpoint: the new device and its token once approved, else a GrantError.

    Raises:
        GrantError: authorization_pending, slow_down, access_denied, expired_token or invalid_grant.
    """
    now = now or timezone.now()
    authorization = DeviceAuthorization.objects.filter(device_code_hash=hash_token(device_code)).first()
    if authorization is None:
        raise GrantError("invalid_grant", "unknown device code; run crowdtrain-agent login again")
    if authorization.consumed_at is not None:
        raise GrantError("invalid_grant", "this device code was already used")
    if authorization.is_expired(now):
        raise GrantError("expired_token", "the code expired before anyone approved it")
    if authorization.denied_at is not None:
        raise GrantError("access_denied", "the volunteer denied this device")
    approver = authorization.approved_by  # no query while nobody has approved
    if approver is None:
        too_fast = (
            authorization.last_polled_at is not None
            and (now - authorization.last_polled_at).total_seconds() < authorization.interval
        )
        if too_fast:
            authorization.interval += SLOW_DOWN_STEP_S
        authorization.last_polled_at = now
        authorization.save(update_fields=["interval", "last_polled_at"])
        if too_fast:
            raise GrantError("slow_down", f"polled too fast; wait {authorization.interval} s between requests")
        raise GrantError("authorization_pending", "waiting for a volunteer to approve the code")

    if not approver.is_active:
        raise GrantError("access_denied", "the account that approved this device has been deactivated")
    with transaction.atomic():
        # Two polls may find the same approval at once: only the one that marks it spent issues a token.
        claimed = DeviceAuthorization.objects.filter(pk=authorization.pk, consumed_at__isnull=True).update(
            consumed_at=now, last_polled_at=now
        )
        if not claimed:
            raise GrantError("invalid_grant", "this device code was already used")
        device, token = Device.issue(approver, authorization.approved_name or authorization.requested_name)
        device.hardware = authorization.hardware
        device.save(update_fields=["hardware"])
        DeviceAuthorization.objects.filter(pk=authorization.pk).update(device=device)
    logger.info("device %s issued to %s by device code", device.pk, device.owner_id)
    return device, token


def find_pending(raw_user_code: str, now: datetime | None = None) -> DeviceAuthorization:
    """The authorization a volunteer typed the user code of, if it can still be approved.

    Raises:
        CodeProblem: with a message for the volunteer (malformed, unknown, used, expired).
    """
    code = normalize_user_code(raw_user_code)
    shown = str(raw_user_code).strip()[:20]
    if code is None:
        raise CodeProblem(
            f"“{shown}” is not a device code: codes are 8 letters like WDJB-MJHT. "
            "Copy the code that crowdtrain-agent login printed in your terminal."
        )
    authorization = DeviceAuthorization.objects.filter(user_code=code).order_by("-created_at").first()
    if authorization is None:
        raise CodeProblem(
            f"No device is waiting for code {format_user_code(code)}. Check it against your terminal, "
            "or run crowdtrain-agent login again for a new code."
        )
    if authorization.is_decided or authorization.consumed_at is not None:
        raise CodeProblem(
            f"Code {format_user_code(code)} was already used. Run crowdtrain-agent login again for a new code."
        )
    if authorization.is_expired(now):
        raise CodeProblem(
            f"Code {format_user_code(code)} has expired. Run crowdtrain-agent login again for a new code."
        )
    return authorization


def _undecided(authorization: DeviceAuthorization, now: datetime) -> QuerySet[DeviceAuthorization]:
    return DeviceAuthorization.objects.filter(
        pk=authorization.pk,
        approved_by__isnull=True,
        denied_at__isnull=True,
        consumed_at__isnull=True,
        expires_at__gt=now,
    )


def approve(authorization: DeviceAuthorization, user: AbstractBaseUser, name: str) -> bool:
    """Bind the coming device to ``user`` under ``name``; False if it was decided or expired meanwhile."""
    approved = bool(_undecided(authorization, timezone.now()).update(approved_by=user, approved_name=name))
    if approved:
        logger.info("device code %s approved by %s", authorization.pk, user.pk)
    return approved


def deny(authorization: DeviceAuthorization) -> bool:
    """Refuse the device; its agent hears access_denied. False if it was decided or expired meanwhile."""
    now = timezone.now()
    return bool(_undecided(authorization, now).update(denied_at=now))
