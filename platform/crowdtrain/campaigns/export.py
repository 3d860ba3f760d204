"""Downloading a campaign's model: safetensors weights of a validated version plus a JSON config.

The exportable versions are those the validation task stored (every
``validate_every`` steps and at the finish, see ``validation``): the site
keeps its own copy of their parameters in default storage, so an export
works whether or not the aggregators still hold that version, and the
weights are exactly the ones whose validation loss the page shows.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth.decorators import login_required
from django.core.files.storage import default_storage
from django.http import FileResponse, Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404
from django.urls import reverse
from django.views.decorators.http import require_GET

from .models import Campaign, ValidationResult
from .organizers import is_organizer, managed_campaigns

SNIPPET = (
    "# pip install crowdtrain-agent\n"
    "from crowdtrain_agent.models import load_exported\n"
    'model = load_exported("model.safetensors", "config.json")'
)


class ExportRequestError(ValueError):
    """A version the request cannot export; ``status`` is the HTTP answer."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def exports(campaign: Campaign) -> list[ValidationResult]:
    """The versions with stored weights, newest first."""
    return list(campaign.validation_results.exclude(weights="").order_by("-version"))


def pick_export(campaign: Campaign, raw_version: str | None) -> ValidationResult:
    """The stored version named by ``?version=``, or the newest one when it is left out.

    Raises:
        ExportRequestError: for a version that is not an integer (400) or has no stored weights (404).
    """
    stored = exports(campaign)
    if raw_version in (None, ""):
        if not stored:
            raise ExportRequestError(
                "nothing to export yet: weights are stored with each validation loss, "
                f"every {campaign.validate_every} steps and when the campaign finishes",
                404,
            )
        return stored[0]
    try:
        version = int(raw_version)
    except ValueError:
        raise ExportRequestError(f"version must be an integer, got {raw_version!r}", 400) from None
    for result in stored:
        if result.version == version:
            return result
    known = ", ".join(str(r.version) for r in stored[:10]) or "none yet"
    raise ExportRequestError(f"version {version} was not exported; exported versions: {known}", 404)


def export_config(campaign: Campaign, result: ValidationResult) -> dict[str, Any]:
    """What ``config.json`` holds: enough to rebuild the model (``load_exported``) and to know what it is."""
    return {
        "format": "crowdtrain-export/1",
        "campaign": {"id": campaign.pk, "name": campaign.name},
        "architecture": campaign.architecture,
        "model_config": campaign.model_config,
        "param_count": campaign.param_count,
        "version": result.version,
        "step": result.version,  # version v holds the parameters after v optimizer steps
        "val_loss": result.loss,
        "val_samples": result.num_samples,
        "dataset": {
            "name": campaign.dataset.name,
            "kind": campaign.dataset.kind,
            "sample_len": campaign.dataset.sample_len,
        },
        "optimizer": campaign.optimizer,
        "seed": campaign.seed,
    }


def export_context(campaign: Campaign) -> dict[str, Any]:
    """For the campaign page's export card (``campaigns/_export.html``)."""
    return {
        "versions": [
            {
                "version": r.version,
                "loss": r.loss,
                "weights_url": f"{reverse('campaign-export', args=[campaign.pk])}?version={r.version}",
                "config_url": f"{reverse('campaign-export-config', args=[campaign.pk])}?version={r.version}",
            }
            for r in exports(campaign)
        ],
        "snippet": SNIPPET,
    }


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
def campaign_export_config(request: HttpRequest, campaign_id: int) -> HttpResponse:
    campaign, result = _requested_export(request, campaign_id)
    if isinstance(result, JsonResponse):
        return result
    response = JsonResponse(export_config(campaign, result), json_dumps_params={"indent": 2})
    response["Content-Disposition"] = 'attachment; filename="config.json"'
    return response
