"""The site's typed readers of environment variables, on the loader the agent and the aggregator use too."""

from __future__ import annotations

import os
from typing import Any

import dj_email_url
from django.core.exceptions import ImproperlyConfigured

from crowdtrain_agent.settings_loader import Setting, SettingError, parse


def _read(name: str, default: Any, setting: Setting) -> Any:
    """The variable checked by the loader all three programs share, or ``default`` when it is unset."""
    raw = os.getenv(name)
    if raw is None:
        return default
    try:
        return parse(setting, name, raw)
    except SettingError as exc:
        raise ImproperlyConfigured(str(exc)) from None


def env_str(name: str, default: str) -> str:
    return os.getenv(name, default)


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    accepts = "must be an integer" if minimum is None else f"must be an integer of at least {minimum}"
    return int(_read(name, default, Setting("value", int, accepts=accepts, ge=minimum)))


def env_float(name: str, default: float, *, minimum: float | None = None) -> float:
    accepts = "must be a number" if minimum is None else f"must be a number of at least {minimum}"
    return float(_read(name, default, Setting("value", float, accepts=accepts, ge=minimum)))


def _on_off(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off", ""}:
        return False
    raise ValueError("neither true nor false")


def env_bool(name: str, default: bool) -> bool:
    setting = Setting("value", bool, accepts="must be true or false (1/0, yes/no)", check=_on_off)
    return bool(_read(name, default, setting))


def _key(raw: str) -> bytes:
    try:
        value = bytes.fromhex(raw)
    except ValueError:
        raise ValueError("must be hexadecimal (e.g. from `openssl rand -hex 32`)") from None
    if len(value) < 16:
        raise ValueError(f"must hold at least 16 bytes (32 hex digits), not {len(value)}")
    return value


def env_hex_bytes(name: str, default: bytes) -> bytes:
    return bytes(_read(name, default, Setting("value", bytes, check=_key, secret=True)))


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
    def choose(raw: str) -> str:
        if raw.strip().lower() not in choices:
            raise ValueError("not a choice")
        return raw.strip().lower()

    accepts = f"must be one of {', '.join(choices)}"
    return str(_read(name, default, Setting("value", str, accepts=accepts, check=choose)))
