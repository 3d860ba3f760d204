"""The "Compute in this tab" page: a volunteer's browser tab becomes one of their devices (issue 36).

The page only checks the browser, gets the tab a device token and starts its Web Worker
(``frontend/src/tab/``), which speaks the agent's protocol over ``/ws/agent/``. Everything the worker
needs to find the site is in one ``json_script`` config, so the script holds no URL of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.templatetags.static import static
from django.views.decorators.http import require_GET

from .isolation import ISOLATION_HEADERS
from .models import Campaign
from .visibility import can_watch

# The tab's other endpoints (issue 36's parts A and B): a device for the tab, the campaign's gated graph.
TAB_DEVICE_PATH = "/devices/tab/"
BROWSER_API_PATH = "/api/campaigns/{campaign_id}/browser/"
SHARD_PATH = "/api/shards/"
AGENT_SOCKET_PATH = "/ws/agent/"


def cross_origin_isolated(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """Send ISOLATION_HEADERS with the view's response."""

    @wraps(view)
    def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        response = view(request, *args, **kwargs)
        for name, value in ISOLATION_HEADERS.items():
            response.headers.setdefault(name, value)
        return response

    return wrapped


def tab_config(request: HttpRequest, campaign: Campaign) -> dict[str, Any]:
    """What the page and its worker need to know, all of it URLs of this site."""
    scheme = "wss" if request.is_secure() else "ws"
    return {
        "campaign_id": campaign.pk,
        "user_id": request.user.pk,
        "ws_url": f"{scheme}://{request.get_host()}{AGENT_SOCKET_PATH}",
        "shard_url": request.build_absolute_uri(SHARD_PATH),
        "browser_api_url": BROWSER_API_PATH.format(campaign_id=campaign.pk),
        "tab_device_url": TAB_DEVICE_PATH,
        "worker_url": static("build/tab-worker.js"),
        "ort_url": request.build_absolute_uri(static("build/ort/")),
        # WebGPU where the browser gives an adapter and the volunteer asks for it (?webgpu=1): correctness
        # is gated on the wasm path; WebGPU is offered for speed, by choice.
        "webgpu": request.GET.get("webgpu") == "1",
    }


@require_GET
@login_required
@cross_origin_isolated
def tab(request: HttpRequest, campaign_id: int) -> HttpResponse:
    campaign = get_object_or_404(Campaign.objects.exclude(state=Campaign.State.DRAFT), pk=campaign_id)
    if not can_watch(request.user, campaign):  # invite-only: only for its volunteers
        raise Http404(f"no campaign {campaign_id}")
    context = {
        "campaign": campaign,
        "config": tab_config(request, campaign),
        "finished": campaign.state == Campaign.State.FINISHED,
    }
    return render(request, "campaigns/tab.html", context)
