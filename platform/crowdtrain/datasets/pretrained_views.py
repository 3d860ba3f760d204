"""Organizers' pretrained weights: the uploader, and a page per upload with its live conversion."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from crowdtrain.campaigns.organizers import is_organizer

from .dataset_views import _organizer
from .models import Pretrained, Upload
from .permissions import visible_pretrained


def pretrained_status_json(weights: Pretrained) -> dict[str, Any]:
    return {
        "id": weights.pk,
        "name": weights.name,
        "status": weights.status,
        "progress": round(weights.progress, 4),
        "error": weights.error,
        "architecture": weights.architecture,
        "param_count": weights.param_count,
    }


@login_required
@require_GET
def pretrained_upload_page(request: HttpRequest) -> HttpResponse:
    _organizer(request)
    return render(
        request,
        "pretrained/new.html",
        {
            "format": Upload.PRETRAINED,
            "max_upload_bytes": settings.CROWDTRAIN_MAX_UPLOAD_BYTES,
            "chunk_bytes": settings.CROWDTRAIN_UPLOAD_CHUNK_BYTES,
        },
    )


@login_required
@require_GET
def pretrained_detail(request: HttpRequest, pretrained_id: int) -> HttpResponse:
    _organizer(request)
    weights = visible_pretrained(request.user).filter(pk=pretrained_id).first()
    if weights is None:  # someone else's weights are as unknown as missing ones
        raise Http404("unknown pretrained weights")
    return render(request, "pretrained/detail.html", {"weights": weights, "status": pretrained_status_json(weights)})


@require_GET
def pretrained_status(request: HttpRequest, pretrained_id: int) -> JsonResponse:
    if not request.user.is_authenticated:
        return JsonResponse({"error": "log in first"}, status=401)
    if not is_organizer(request.user):
        return JsonResponse({"error": "only organizers can see pretrained weights"}, status=403)
    weights = visible_pretrained(request.user).filter(pk=pretrained_id).first()
    if weights is None:
        return JsonResponse({"error": "unknown pretrained weights"}, status=404)
    return JsonResponse(pretrained_status_json(weights))
