"""/metrics wants the bearer token once one is configured, and otherwise only the deployment's own network."""

from __future__ import annotations

import pytest
from django.test import Client, override_settings

pytestmark = pytest.mark.django_db


@override_settings(CROWDTRAIN_METRICS_TOKEN="s3cret-metrics-token")
def test_with_a_token_configured_a_scrape_without_it_is_refused() -> None:
    client = Client()

    anonymous = client.get("/metrics")
    wrong = client.get("/metrics", HTTP_AUTHORIZATION="Bearer not-it")
    right = client.get("/metrics", HTTP_AUTHORIZATION="Bearer s3cret-metrics-token")

    assert anonymous.status_code == 401 and "CROWDTRAIN_METRICS_TOKEN" in anonymous.json()["error"]
    assert wrong.status_code == 401
    assert right.status_code == 200 and b"crowdtrain_campaigns" in right.content


@override_settings(CROWDTRAIN_METRICS_TOKEN="")
def test_without_a_token_only_unproxied_private_addresses_are_answered() -> None:
    local = Client(REMOTE_ADDR="127.0.0.1").get("/metrics")
    private = Client(REMOTE_ADDR="10.0.3.7").get("/metrics")
    public = Client(REMOTE_ADDR="93.184.216.34").get("/metrics")
    relayed = Client(REMOTE_ADDR="10.0.3.7").get("/metrics", HTTP_X_FORWARDED_FOR="203.0.113.9")

    assert (local.status_code, private.status_code) == (200, 200)
    assert (public.status_code, relayed.status_code) == (403, 403)
