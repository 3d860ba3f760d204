"""Who may read the site's ``/metrics``: the rule of ``crowdtrain_agent.scrape_access``, with the site's token.

Prometheus reads the token from a file (deploy/prometheus/prometheus.yml);
the balancer refuses ``/metrics`` from outside as well.
"""

from __future__ import annotations

from django.conf import settings
from django.http import HttpRequest, JsonResponse

from crowdtrain_agent.scrape_access import scrape_refusal

SETTING = "CROWDTRAIN_METRICS_TOKEN"


def site_scrape_refusal(
    authorization: str | None, header_names: list[str], remote_address: str
) -> tuple[int, str] | None:
    """Why a scrape of the site is refused, as (HTTP status, message); None if it may read."""
    return scrape_refusal(
        settings.CROWDTRAIN_METRICS_TOKEN, authorization, header_names, remote_address, setting=SETTING
    )


def metrics_refusal(request: HttpRequest) -> JsonResponse | None:
    """None if ``request`` may read the metrics, else the 401 or 403 answer to send."""
    refused = site_scrape_refusal(
        request.headers.get("Authorization"), list(request.headers), request.META.get("REMOTE_ADDR") or ""
    )
    if refused is None:
        return None
    status, message = refused
    return JsonResponse({"error": message}, status=status)
