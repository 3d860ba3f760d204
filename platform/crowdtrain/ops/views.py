"""Health and metrics endpoints (``/livez`` for balancers, ``/healthz`` for monitors, ``/metrics`` for Prometheus)
and the admins' live dashboard page (``/dashboard/``; its data comes over ``/ws/dashboard/``).

Two health checks because a balancer and a monitor ask different questions.
HAProxy asks "does this process answer?" (``/livez``, every second, no
database): a campaign whose aggregator is gone is no reason to take a site
process out of rotation, and taking every process out would leave volunteers
and organizers with nothing at all. A monitor asks "is the service doing its
job?" (``/healthz``): ``{"status": ..., "summary": ..., "alerts": [...]}``,
``"degraded"`` while any critical alert fires (a silent aggregator, a campaign
waiting for aggregators, blocked, or stalled with volunteers present),
``"warning"`` for warnings only (a campaign nobody works on, a spike of failed
leases, a failing Celery task), ``"ok"`` otherwise; each alert names its
campaign and what to do. The answer is 200 whatever the campaigns do, and 503
only when this site cannot serve (its database or Redis do not answer): a
campaign's trouble is for the alerts, not a reason to call the site down.
"""

from __future__ import annotations

import logging

import redis
from django.conf import settings
from django.db import DatabaseError
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from crowdtrain.accounts.access import staff_required
from crowdtrain.campaigns.models import Campaign

from . import health
from .access import metrics_refusal

logger = logging.getLogger(__name__)


@require_GET
def livez(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "live"})


@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    try:
        alerts = health.evaluate()
        running = Campaign.objects.filter(state=Campaign.State.RUNNING).count()
    except (DatabaseError, redis.RedisError) as exc:
        logger.warning("health check: cannot read the database or Redis: %s", exc)
        return JsonResponse(
            {"status": "down", "error": f"cannot read the database or Redis ({type(exc).__name__}); see the log"},
            status=503,
        )
    body = {"status": health.status_of(alerts), "summary": health.summary(alerts), "running_campaigns": running}
    return JsonResponse({**body, "alerts": [a.as_dict() for a in alerts]})


@require_GET
def metrics(request: HttpRequest) -> HttpResponse:
    refused = metrics_refusal(request)
    if refused is not None:
        return refused
    try:
        body = generate_latest(REGISTRY)
    except (DatabaseError, redis.RedisError) as exc:
        # Prometheus records the target as down (up == 0); the alert rules say what that means.
        logger.warning("metrics: cannot read the database or Redis: %s", exc)
        return JsonResponse({"error": "cannot read the database or Redis; see the site's log"}, status=503)
    return HttpResponse(body, content_type=CONTENT_TYPE_LATEST)


@staff_required
@require_GET
def dashboard(request: HttpRequest) -> HttpResponse:
    return render(request, "ops/dashboard.html", {"push_s": settings.CROWDTRAIN_DASHBOARD_PUSH_S})
