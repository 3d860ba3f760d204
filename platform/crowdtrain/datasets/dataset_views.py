"""Organizers' dataset pages: the uploader, their datasets, and live sharding progress."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from crowdtrain.campaigns.organizers import is_organizer
from crowdtrain_agent.models import max_text_sample_len
from crowdtrain_agent.models.registry import IMAGE_SIZES, MAX_VOCAB

from .models import Dataset, Shard, Upload
from .permissions import visible_datasets, visible_pretrained, visible_uploads


def _organizer(request: HttpRequest) -> None:
    if not is_organizer(request.user):
        raise PermissionDenied("only organizers can upload and manage datasets")


def _visible(request: HttpRequest, dataset_id: int) -> Dataset:
    dataset = visible_datasets(request.user).filter(pk=dataset_id).first()
    if dataset is None:  # someone else's dataset is as unknown as a missing one
        raise Http404("unknown dataset")
    return dataset


def dataset_status_json(dataset: Dataset) -> dict[str, Any]:
    counts = {split: 0 for split in Shard.Split.values}
    for split in dataset.shards.values_list("split", flat=True):
        counts[split] += 1
    return {
        "id": dataset.pk,
        "name": dataset.name,
        "status": dataset.status,
        "progress": round(dataset.progress, 4),
        "error": dataset.error,
        "kind": dataset.kind,
        "format": dataset.source_format,
        "sample_len": dataset.sample_len,
        "num_samples": dataset.num_samples,
        "num_validation_samples": dataset.num_validation_samples,
        "size_bytes": dataset.size_bytes,
        "train_shards": counts[Shard.Split.TRAIN],
        "validation_shards": counts[Shard.Split.VALIDATION],
        "stage": dataset.stage if dataset.status == Dataset.Status.SHARDING else "",
        "tokenizer": dataset.tokenizer_sha256,
        "vocab_size": dataset.vocab_size,
        "image_size": dataset.image_size,
        "classes": len(dataset.labels),
        "skipped_count": dataset.skipped_count,
    }


@login_required
@require_GET
def dataset_list(request: HttpRequest) -> HttpResponse:
    _organizer(request)
    datasets = visible_datasets(request.user).select_related("owner").order_by("-created_at")
    unfinished = visible_uploads(request.user).filter(state=Upload.State.RECEIVING)
    pretrained = visible_pretrained(request.user).order_by("-created_at")
    return render(
        request, "datasets/list.html", {"datasets": datasets, "unfinished": unfinished, "pretrained": pretrained}
    )


@login_required
@require_GET
def dataset_upload_page(request: HttpRequest) -> HttpResponse:
    _organizer(request)
    return render(
        request,
        "datasets/new.html",
        {
            "formats": Dataset.Format.choices,
            "max_upload_bytes": settings.CROWDTRAIN_MAX_UPLOAD_BYTES,
            "chunk_bytes": settings.CROWDTRAIN_UPLOAD_CHUNK_BYTES,
            "max_sample_len": max_text_sample_len(),
            "validation_percent": settings.CROWDTRAIN_VALIDATION_FRACTION * 100,
            "default_vocab": settings.CROWDTRAIN_TOKENIZER_VOCAB,
            "max_vocab": MAX_VOCAB,
            "max_tokenizer_bytes": settings.CROWDTRAIN_MAX_TOKENIZER_BYTES,
            "default_image_size": settings.CROWDTRAIN_IMAGE_SIZE,
            "image_sizes": IMAGE_SIZES,
            # Tokenizers that came with pretrained weights: a dataset for them must be tokenized by them.
            "pretrained_tokenizers": visible_pretrained(request.user)
            .filter(status="ready")
            .exclude(tokenizer_sha256="")
            .values_list("name", "tokenizer_sha256"),
        },
    )


@login_required
@require_GET
def dataset_detail(request: HttpRequest, dataset_id: int) -> HttpResponse:
    _organizer(request)
    dataset = _visible(request, dataset_id)
    return render(request, "datasets/detail.html", {"dataset": dataset, "status": dataset_status_json(dataset)})


@require_GET
def dataset_status(request: HttpRequest, dataset_id: int) -> JsonResponse:
    if not request.user.is_authenticated:
        return JsonResponse({"error": "log in first"}, status=401)
    if not is_organizer(request.user):
        return JsonResponse({"error": "only organizers can see datasets"}, status=403)
    dataset = visible_datasets(request.user).filter(pk=dataset_id).first()
    if dataset is None:
        return JsonResponse({"error": "unknown dataset"}, status=404)
    return JsonResponse(dataset_status_json(dataset))
