"""HTTP views: shard downloads for agents, and the campaign progress and shard coverage feeds."""

from __future__ import annotations

import re

from django.core.files.storage import default_storage
from django.db.models import Q, Sum
from django.http import FileResponse, HttpRequest, HttpResponse, HttpResponseBase, JsonResponse
from django.shortcuts import get_object_or_404, render
from django.views.decorators.http import require_GET

from crowdtrain.accounts.models import Device
from crowdtrain.accounts.tokens import bearer_token
from crowdtrain.datasets.models import shard_storage_name
from crowdtrain.datasets.permissions import data_holders
from crowdtrain.ops import campaign_monitor as monitor
from crowdtrain.ops.coverage import coverage_map

from .models import Campaign
from .permissions import can_download_shard
from .visibility import can_watch, open_campaigns

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_RANGE = re.compile(r"^bytes=([0-9]{0,19})-([0-9]{0,19})$")  # ASCII digits, no longer than any file size
SHARD_BLOCK_BYTES = 512 << 10  # what a shard download sends per write


def _error(message: str, status: int) -> JsonResponse:
    return JsonResponse({"error": message}, status=status)


@require_GET
def shard(request: HttpRequest, sha256: str) -> HttpResponseBase:
    """A shard's bytes (or a token dataset's tokenizer.json); immutable, so cacheable forever, with ETag and ranges."""
    device = Device.authenticate(bearer_token(dict(request.headers)))
    if device is None or device.is_revoked:
        return _error("invalid or revoked device token", 401)
    if not _SHA256.match(sha256) or not data_holders(sha256).exists():
        return _error("unknown shard", 404)
    # Before the ETag check, so a 304 cannot tell a stranger that a private shard exists.
    if not can_download_shard(device, sha256):
        return _error("shard of an invite-only campaign you are not invited to", 403)
    etag = f'"{sha256}"'
    if request.headers.get("If-None-Match") == etag:
        return HttpResponse(status=304, headers={"ETag": etag})
    name = shard_storage_name(sha256)
    size = default_storage.size(name)
    headers = {"ETag": etag, "Accept-Ranges": "bytes", "Cache-Control": "private, max-age=31536000, immutable"}
    match = _RANGE.match(request.headers.get("Range", ""))
    if request.headers.get("Range") and match:
        first, last = match.groups()
        if first == "":  # suffix range: the last N bytes
            start, end = max(0, size - int(last or 0)), size - 1
        else:
            start, end = int(first), min(size - 1, int(last)) if last else size - 1
        if start > end or start >= size:
            return HttpResponse(status=416, headers={"Content-Range": f"bytes */{size}"})
        with default_storage.open(name, "rb") as fh:
            fh.seek(start)
            body = fh.read(end - start + 1)
        response = HttpResponse(body, status=206, content_type="application/octet-stream", headers=headers)
        response["Content-Range"] = f"bytes {start}-{end}/{size}"
        return response
    stream = FileResponse(default_storage.open(name, "rb"), content_type="application/octet-stream", headers=headers)
    stream["Content-Length"] = str(size)
    # Django's 4 KiB default makes a 4 MiB shard a thousand ASGI messages, each a wake-up of the
    # agent's download thread next to its computing one.
    stream.block_size = SHARD_BLOCK_BYTES
    return stream


@require_GET
def initial_weights(request: HttpRequest, sha256: str) -> HttpResponseBase:
    """A campaign's pretrained weights (flat fp32), for the aggregators that hold a slice of it: its version 0.

    Whole, not a range: the aggregator checks the sha256 of every byte before it starts the campaign from them.
    """
    from crowdtrain.datasets.pretrained import weights_storage_name
    from crowdtrain.scheduler.models import Aggregator

    aggregator = Aggregator.authenticate(bearer_token(dict(request.headers)))
    if aggregator is None:
        return _error("invalid backbone token", 401)
    held = aggregator.slices.filter(
        Q(campaign__initial_weights=sha256)
        | Q(campaign__initial_weights="", campaign__pretrained__weights_sha256=sha256)
    )
    if not _SHA256.match(sha256) or not held.exists():
        return _error("no campaign of yours starts from these weights", 404)
    name = weights_storage_name(sha256)
    stream = FileResponse(default_storage.open(name, "rb"), content_type="application/octet-stream")
    stream["Content-Length"] = str(default_storage.size(name))
    stream["ETag"] = f'"{sha256}"'
    stream.block_size = SHARD_BLOCK_BYTES
    return stream


def _progress(campaign: Campaign) -> dict:
    """The public progress feed and the campaign list's card: the monitor's own figures, cheap for long runs.

    Contributors are the leaderboard's (the organizer page counts the same way), and the loss
    curve is the monitor's downsampled series (one point per step up to ``monitor.MAX_POINTS``
    steps), so a campaign three weeks old costs what a young one does.
    """
    series = monitor.series(campaign)
    pace = monitor.recent_pace(campaign)
    return {
        "id": campaign.pk,
        "name": campaign.name,
        "state": campaign.state,
        "architecture": campaign.architecture,
        "param_count": campaign.param_count,
        "target_batch_size": campaign.target_batch_size,
        "max_steps": campaign.max_steps,
        "committed_steps": campaign.committed_steps,
        "version": campaign.version,
        "epoch": campaign.epoch,
        "samples": campaign.steps.aggregate(n=Sum("num_samples"))["n"] or 0,
        "samples_per_s": pace.samples_per_s or 0.0,
        "contributors": monitor.contributor_count(campaign),
        "active_leases": campaign.leases.filter(state="active").count(),
        # Training loss per point of the series: per step while there are at most MAX_POINTS steps.
        "losses": [loss for loss in series["loss"] if loss is not None],
        "steps_per_point": series["steps_per_point"],
        "series": {key: series[key] for key in ("step", "loss", "val_step", "val_loss")},
        # Held-out loss every validate_every steps: [{"version", "loss", "num_samples"}], oldest first.
        "val_loss": list(
            campaign.validation_results.filter(loss__isnull=False)
            .order_by("version")
            .values("version", "loss", "num_samples")
        ),
    }


@require_GET
def progress(request: HttpRequest, campaign_id: int) -> JsonResponse:
    campaign = get_object_or_404(Campaign, pk=campaign_id)
    if not can_watch(request.user, campaign):  # the same answer as for no campaign: nothing leaks
        return _error(f"no campaign {campaign_id}", 404)
    return JsonResponse(_progress(campaign))


@require_GET
def coverage(request: HttpRequest, campaign_id: int) -> JsonResponse:
    """Which samples of the current epoch each shard has done, leased, returned...: ``coverage.coverage_map``."""
    campaign = Campaign.objects.select_related("dataset").filter(pk=campaign_id).first()
    # Whoever may watch the progress feed may watch this; to anyone else the campaign does not exist.
    if campaign is None or not can_watch(request.user, campaign):
        return _error(f"no campaign {campaign_id}", 404)
    # Compact separators: a map of 2,000 cells is polled every 10 s by each open campaign page.
    return JsonResponse(coverage_map(campaign), json_dumps_params={"separators": (",", ":")})


@require_GET
def index(request: HttpRequest) -> HttpResponse:
    cards = [{**_progress(c), "series_element": f"campaign-series-{c.pk}"} for c in open_campaigns()]
    return render(request, "campaigns/index.html", {"campaigns": cards})
