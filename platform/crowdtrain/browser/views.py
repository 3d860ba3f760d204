"""What a browser tab asks the site before it computes: a campaign's verdict and graphs, and a graph's bytes.

Same origin as the tab's page. The caller is a device (its token as
``Authorization: Bearer``, as the agent sends it) or a logged-in volunteer (the
page itself); a campaign the caller may not see is a 404, as everywhere.
"""

from __future__ import annotations

import re
from typing import Any

from django.core.files.storage import default_storage
from django.db.models import Q
from django.http import FileResponse, HttpRequest, HttpResponse, HttpResponseBase, JsonResponse
from django.views.decorators.http import require_GET

from crowdtrain.accounts.models import Device
from crowdtrain.accounts.tokens import bearer_token
from crowdtrain.campaigns.browser_checks import browser_verdict
from crowdtrain.campaigns.models import Campaign
from crowdtrain.campaigns.visibility import can_watch
from crowdtrain_agent.models import ModelConfigError, get_model

from .models import BrowserGraph, graph_storage_name

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
GRAPH_BLOCK_BYTES = 512 << 10


def _error(message: str, status: int) -> JsonResponse:
    return JsonResponse({"error": message}, status=status)


def _caller(request: HttpRequest) -> tuple[Any, JsonResponse | None]:
    """The volunteer asking, by device token or session; or the error to answer."""
    if request.headers.get("Authorization"):
        device = Device.authenticate(bearer_token(dict(request.headers)))
        if device is None:
            return None, _error("invalid device token", 401)
        if device.is_revoked:
            return None, _error("this device was revoked; add the tab again from the campaign's page", 403)
        return device.owner, None
    if request.user.is_authenticated:
        return request.user, None
    return None, _error("log in, or send a device token as Authorization: Bearer", 401)


def _graph_entry(sha256: str, size: int) -> dict[str, Any]:
    return {"sha256": sha256, "url": f"/browser/graphs/{sha256}.onnx", "bytes": size}


@require_GET
def campaign_browser(request: HttpRequest, campaign_id: int) -> JsonResponse:
    """Whether a tab may work on this campaign, and the graphs it runs.

    ``graphs`` is keyed by batch size: the microbatch's and, when that is
    above 1, "1" for a lease's last partial microbatch (the same inputs with a
    leading dimension of 1 for ``x`` and ``y``); for a model whose samples do
    not meet in a batch, also a wide graph of several microbatches a run,
    keyed by its batch (a multiple of the microbatch). Empty unless passed.
    """
    user, refused = _caller(request)
    if refused is not None:
        return refused
    campaign = Campaign.objects.filter(pk=campaign_id).first()
    if campaign is None or not can_watch(user, campaign):  # the same answer for both: nothing leaks
        return _error(f"no campaign {campaign_id}", 404)
    verdict = browser_verdict(campaign)
    graph = verdict.graph
    passed = verdict.status == BrowserGraph.Status.PASSED and graph is not None
    graphs: dict[str, Any] = {}
    if passed and graph is not None:
        graphs[str(graph.microbatch_size)] = _graph_entry(graph.sha256, graph.bytes)
        if graph.sha256_one:
            graphs["1"] = _graph_entry(graph.sha256_one, graph.bytes_one)
        if graph.sha256_wide:
            graphs[str(graph.wide_size)] = _graph_entry(graph.sha256_wide, graph.bytes_wide)
    return JsonResponse(
        {
            "status": verdict.status,
            "reason": verdict.reason,
            "microbatch_size": campaign.microbatch_size,
            "graphs": graphs,
            "manifest": graph.manifest if passed and graph is not None else {},
            "memory_bytes": graph.memory_bytes if passed and graph is not None else 0,
            # What a sample of accepted work earns (crowdtrain_agent.credit): the page shows credit as it accrues.
            "flops_per_sample": _flops_per_sample(campaign),
        }
    )


def _flops_per_sample(campaign: Campaign) -> float:
    try:
        return float(get_model(campaign.architecture).flops_per_sample(campaign.model_config))
    except (ModelConfigError, ValueError, TypeError):  # an architecture or config this site no longer knows
        return 0.0


@require_GET
def graph_bytes(request: HttpRequest, sha256: str) -> HttpResponseBase:
    """A passed graph's ONNX bytes; immutable, so cacheable for ever.

    Any caller the API answers may fetch it: a graph holds a model's shape and
    no weights, and its address is learned only from a campaign the caller may see.
    """
    _, refused = _caller(request)
    if refused is not None:
        return refused
    if not _SHA256.match(sha256) or not _passed_graph(sha256):
        return _error("unknown graph", 404)
    etag = f'"{sha256}"'
    headers = {"ETag": etag, "Cache-Control": "public, max-age=31536000, immutable"}
    if request.headers.get("If-None-Match") == etag:
        return HttpResponse(status=304, headers=headers)
    name = graph_storage_name(sha256)
    if not default_storage.exists(name):
        return _error("graph not stored; ask the site's admins to run manage.py check_browser_graphs --again", 404)
    stream = FileResponse(default_storage.open(name, "rb"), content_type="application/octet-stream", headers=headers)
    stream["Content-Length"] = str(default_storage.size(name))
    stream.block_size = GRAPH_BLOCK_BYTES
    return stream


def _passed_graph(sha256: str) -> bool:
    either = Q(sha256=sha256) | Q(sha256_one=sha256) | Q(sha256_wide=sha256)
    graphs = BrowserGraph.objects.filter(either, status=BrowserGraph.Status.PASSED)
    return graphs.exists()
