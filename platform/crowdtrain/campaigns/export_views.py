"""The downloads of a campaign's model: its weights, their config and a transformers folder, for its organizers."""

from __future__ import annotations

import tempfile
from typing import Any

from django.contrib.auth.decorators import login_required
from django.core.files.storage import default_storage
from django.http import FileResponse, Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404
from django.views.decorators.http import require_GET

from .export import ExportRequestError, export_config, pick_export, transformers_folder
from .models import Campaign, ValidationResult
from .organizers import is_organizer, managed_campaigns


def _managed(user: Any, campaign_id: int) -> Campaign:
    """The campaign if ``user`` owns it (as an organizer) or is staff; anyone else learns nothing (404)."""
    if not is_organizer(user):
        raise Http404("unknown campaign")
    return get_object_or_404(managed_campaigns(user), pk=campaign_id)


def _requested_export(request: HttpRequest, campaign_id: int) -> tuple[Campaign, ValidationResult | JsonResponse]:
    """The campaign (404 unless the user manages it) and the version ``?version=`` asks for, or why not."""
    campaign = _managed(request.user, campaign_id)
    try:
        return campaign, pick_export(campaign, request.GET.get("version"))
    except ExportRequestError as exc:
        return campaign, JsonResponse({"error": str(exc)}, status=exc.status)


@login_required
@require_GET
def campaign_export(request: HttpRequest, campaign_id: int) -> FileResponse | JsonResponse:
    campaign, result = _requested_export(request, campaign_id)
    if isinstance(result, JsonResponse):
        return result
    # Streamed from storage (local or S3): a big model never sits in the site's memory.
    response = FileResponse(
        default_storage.open(result.weights, "rb"),
        as_attachment=True,
        filename="model.safetensors",
        content_type="application/octet-stream",  # the name the page snippet loads
    )
    response["ETag"] = f'"c{campaign.pk}-v{result.version}-{result.computed_at.timestamp():.0f}"'
    return response


@login_required
@require_GET
def campaign_export_transformers(request: HttpRequest, campaign_id: int) -> FileResponse | JsonResponse:
    campaign, result = _requested_export(request, campaign_id)
    if isinstance(result, JsonResponse):
        return result
    spool = tempfile.TemporaryFile()  # on disk: a model of billions of parameters is as big as its weights
    try:
        transformers_folder(campaign, result, spool)
    except ExportRequestError as exc:
        spool.close()
        return JsonResponse({"error": str(exc)}, status=exc.status)
    spool.seek(0)
    return FileResponse(
        spool, as_attachment=True, filename=f"campaign-{campaign.pk}-v{result.version}.zip",
        content_type="application/zip",
    )  # fmt: skip


@login_required
@require_GET
def campaign_export_config(request: HttpRequest, campaign_id: int) -> HttpResponse:
    campaign, result = _requested_export(request, campaign_id)
    if isinstance(result, JsonResponse):
        return result
    response = JsonResponse(export_config(campaign, result), json_dumps_params={"indent": 2})
    response["Content-Disposition"] = 'attachment; filename="config.json"'
    return response
