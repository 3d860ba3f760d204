from __future__ import annotations

import pytest
from django.test import override_settings

from crowdtrain.checks import DEV_SECRET_PREFIX, check_production_settings


def test_it_flags_the_development_secret_key_and_the_missing_redis() -> None:
    with override_settings(SECRET_KEY=f"{DEV_SECRET_PREFIX}-0123456789", REDIS_URL=""):
        ids = {problem.id for problem in check_production_settings()}

    assert {"crowdtrain.E001", "crowdtrain.E002"} <= ids


@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")
def test_a_production_configuration_passes() -> None:
    postgres = {"default": {"ENGINE": "django.db.backends.postgresql", "NAME": "crowdtrain"}}

    with override_settings(SECRET_KEY="x" * 50, REDIS_URL="redis://127.0.0.1:6379/0", DATABASES=postgres):
        problems = check_production_settings()

    assert problems == []


def test_ssl_redirect_behind_a_proxy_whose_scheme_header_is_not_trusted_is_flagged() -> None:
    with override_settings(SECURE_SSL_REDIRECT=True, ALLAUTH_TRUSTED_PROXY_COUNT=1, SECURE_PROXY_SSL_HEADER=None):
        ids = {problem.id for problem in check_production_settings()}

    assert "crowdtrain.W002" in ids
