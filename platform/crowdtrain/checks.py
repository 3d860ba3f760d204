"""Settings rules as Django system checks.

Every start-up refuses errors; `manage.py check --deploy` adds production's.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import Error, Warning, register

DEV_SECRET_PREFIX = "insecure-dev-key"


@register(deploy=True)
def check_production_settings(app_configs: Any = None, **kwargs: Any) -> list[Error | Warning]:
    problems: list[Error | Warning] = []
    if settings.SECRET_KEY.startswith(DEV_SECRET_PREFIX):
        problems.append(
            Error(
                "CROWDTRAIN_SECRET_KEY is the development default; tickets and sessions could be forged.",
                hint=(
                    "Set CROWDTRAIN_SECRET_KEY to a long random string "
                    "(python -c 'import secrets; print(secrets.token_urlsafe(50))')."
                ),
                id="crowdtrain.E001",
            )
        )
    if settings.DATABASES["default"]["ENGINE"].endswith("sqlite3"):
        problems.append(
            Warning(
                "The database is SQLite; it serializes every write and suits one machine only.",
                hint="Set DATABASE_URL to a PostgreSQL database.",
                id="crowdtrain.W001",
            )
        )
    if not settings.REDIS_URL:
        problems.append(
            Error(
                "REDIS_URL is not set: the channel layer is in-memory, so only one site process can serve WebSockets.",
                hint="Set REDIS_URL (e.g. redis://127.0.0.1:6379/0).",
                id="crowdtrain.E002",
            )
        )
    if settings.EMAIL_BACKEND == "django.core.mail.backends.console.EmailBackend":
        problems.append(
            Error(
                "E-mail goes to the console: volunteers never receive their verification or password-reset mail, "
                "so nobody can finish signing up.",
                hint="Set CROWDTRAIN_EMAIL_URL (e.g. submission://user:password@mail.example.org) or EMAIL_HOST.",
                id="crowdtrain.E003",
            )
        )
    if settings.SECURE_SSL_REDIRECT and settings.ALLAUTH_TRUSTED_PROXY_COUNT and not settings.SECURE_PROXY_SSL_HEADER:
        problems.append(
            Warning(
                "CROWDTRAIN_SECURE_SSL_REDIRECT is on behind a reverse proxy whose X-Forwarded-Proto is not trusted: "
                "if the proxy ends TLS, every request looks like plain HTTP and is redirected to itself for ever.",
                hint="Set CROWDTRAIN_TRUST_FORWARDED_PROTO=true if the proxy sets X-Forwarded-Proto (deploy/ does).",
                id="crowdtrain.W002",
            )
        )
    return problems


@register()
def check_liveness_settings(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """Aggregators must be asked to beat more often than the silence after which they count as gone."""
    heartbeat_s, gone_after_s = settings.CROWDTRAIN_HEARTBEAT_S, settings.CROWDTRAIN_GONE_AFTER_S
    if heartbeat_s < gone_after_s:
        return []
    return [
        Error(
            f"CROWDTRAIN_HEARTBEAT_S ({heartbeat_s:g} s) is not below CROWDTRAIN_GONE_AFTER_S ({gone_after_s:g} s): "
            "an aggregator that beats on time would count as gone between two heartbeats, "
            "and its campaigns would pause.",
            hint=f"Lower CROWDTRAIN_HEARTBEAT_S or raise CROWDTRAIN_GONE_AFTER_S; a heartbeat every "
            f"{gone_after_s / 5:g} s survives a few lost ones within {gone_after_s:g} s.",
            id="crowdtrain.E004",
        )
    ]
