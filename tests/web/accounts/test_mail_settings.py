from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from crowdtrain.checks import check_production_settings
from crowdtrain.env import env_email_url


def test_an_email_url_names_the_smtp_server(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CT_TEST_EMAIL", "submission://mailer%40example.org:s%3Acret@mail.example.org")

    parsed = env_email_url("CT_TEST_EMAIL")

    assert parsed is not None
    assert parsed["EMAIL_BACKEND"] == "django.core.mail.backends.smtp.EmailBackend"
    assert (parsed["EMAIL_HOST"], parsed["EMAIL_PORT"], parsed["EMAIL_USE_TLS"]) == ("mail.example.org", 587, True)
    assert (parsed["EMAIL_HOST_USER"], parsed["EMAIL_HOST_PASSWORD"]) == ("mailer@example.org", "s:cret")


def test_an_unknown_email_url_scheme_stops_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CT_TEST_EMAIL", "carrier-pigeon://coop")

    with pytest.raises(ImproperlyConfigured, match="CT_TEST_EMAIL must be an e-mail URL"):
        env_email_url("CT_TEST_EMAIL")


def test_production_refuses_console_email() -> None:
    with override_settings(EMAIL_BACKEND="django.core.mail.backends.console.EmailBackend"):
        ids = {problem.id for problem in check_production_settings()}

    assert "crowdtrain.E003" in ids
