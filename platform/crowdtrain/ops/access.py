"""Who may read ``/metrics``: a bearer token when one is configured, else only the deployment's own network.

Metrics name campaigns, aggregators and volunteers' counts: not for the
public. With ``CROWDTRAIN_METRICS_TOKEN`` set (production), a scrape must send
``Authorization: Bearer <token>``; Prometheus reads it from a file
(deploy/prometheus/prometheus.yml). Without a token, only loopback and private
addresses are answered, and only when no proxy relayed the request: behind
HAProxy every request comes from a private address, and the balancer's
``X-Forwarded-For`` is what tells a volunteer's request from Prometheus's
(the balancer refuses ``/metrics`` from outside as well).
"""

from __future__ import annotations

import hmac
import ipaddress

from django.conf import settings
from django.http import HttpRequest, JsonResponse

from crowdtrain.accounts.tokens import bearer_token


def _inside(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return ip.is_loopback or ip.is_private


def scrape_refusal(authorization: str | None, forwarded: bool, remote_address: str) -> tuple[int, str] | None:
    """Why a scrape is refused, as (HTTP status, message); None if it may read.

    ``authorization``: its Authorization header; ``forwarded``: a proxy relayed it (X-Forwarded-For).
    """
    expected = settings.CROWDTRAIN_METRICS_TOKEN
    if expected:
        sent = bearer_token({"Authorization": authorization or ""}) or ""
        if not hmac.compare_digest(sent.encode(), expected.encode()):
            return 401, "send the metrics token as Authorization: Bearer (CROWDTRAIN_METRICS_TOKEN)"
        return None
    if forwarded or not _inside(remote_address):
        return (
            403,
            "metrics are served to the deployment's network only; set CROWDTRAIN_METRICS_TOKEN "
            "to scrape from elsewhere",
        )
    return None


def metrics_refusal(request: HttpRequest) -> JsonResponse | None:
    """None if ``request`` may read the metrics, else the 401 or 403 answer to send."""
    refused = scrape_refusal(
        request.headers.get("Authorization"),
        "X-Forwarded-For" in request.headers,
        request.META.get("REMOTE_ADDR") or "",
    )
    if refused is None:
        return None
    status, message = refused
    return JsonResponse({"error": message}, status=status)
