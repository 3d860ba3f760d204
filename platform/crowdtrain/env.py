"""Typed readers for settings from environment variables; a bad value stops start-up loudly."""

from __future__ import annotations

import os

import dj_email_url
from django.core.exceptions import ImproperlyConfigured


def env_str(name: str, default: str) -> str:
    return os.getenv(name, default)


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    raw = os.getenv(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be an integer, got {raw!r}") from None
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name} must be at least {minimum}, got {value}")
    return value


def env_float(name: str, default: float, *, minimum: float | None = None) -> float:
    raw = os.getenv(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be a number, got {raw!r}") from None
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name} must be at least {minimum}, got {value}")
    return value


def env_bool(name: str, default: bool) -> bool:
    raw = os.getenv(name)
    if raw is None:
        return default
    lowered = raw.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off", ""}:
        return False
    raise ImproperlyConfigured(f"{name} must be true or false (1/0, yes/no), got {raw!r}")


def env_hex_bytes(name: str, default: bytes) -> bytes:
    raw = os.getenv(name)
    if raw is None:
        return default
    try:
        value = bytes.fromhex(raw)
    except ValueError:
        raise ImproperlyConfigured(
            f"{name} must be hexadecimal (e.g. from `openssl rand -hex 32`), got {raw!r}"
        ) from None
    if len(value) < 16:
        raise ImproperlyConfigured(f"{name} must hold at least 16 bytes (32 hex digits), got {len(value)}")
    return value


def env_list(name: str, default: list[str]) -> list[str]:
    raw = os.getenv(name)
    if raw is None:
        return default
    return [item.strip() for item in raw.split(",") if item.strip()]


def env_email_url(name: str) -> dict[str, object] | None:
    """Django's EMAIL_* settings from a URL like ``smtp://user:pass@host:587/?tls=True``; None when unset."""
    raw = os.getenv(name)
    if not raw:
        return None
    try:
        parsed = dj_email_url.parse(raw)
    except ValueError:  # a port that is not a number
        parsed = {}
    if "EMAIL_BACKEND" not in parsed:  # the library skips unknown schemes silently
        schemes = ", ".join(sorted(dj_email_url.SCHEMES))
        raise ImproperlyConfigured(
            f"{name} must be an e-mail URL with one of the schemes {schemes} "
            f"(e.g. smtp://user:password@mail.example.org:587/?tls=True), got {raw!r}"
        )
    return parsed


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    raw = os.getenv(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value not in choices:
        raise ImproperlyConfigured(f"{name} must be one of {', '.join(choices)}, got {raw!r}")
    return value
