"""Who may see which datasets, uploads and pretrained weights: their owners, and staff."""

from __future__ import annotations

from typing import Any

from django.db.models import Q

from .models import Dataset, Pretrained, Upload


def visible_datasets(user: Any) -> Any:
    """The datasets ``user`` may see and use: their own, or all of them for staff."""
    datasets = Dataset.objects.all()
    return datasets if user.is_staff else datasets.filter(owner=user)


def visible_pretrained(user: Any) -> Any:
    """The pretrained weights ``user`` may see and start from: their own, or all of them for staff."""
    weights = Pretrained.objects.all()
    return weights if user.is_staff else weights.filter(owner=user)


def visible_uploads(user: Any) -> Any:
    """Uploads belong to their owner alone: staff see datasets, not other people's half-sent files."""
    return Upload.objects.filter(owner=user)


def data_holders(sha256: str) -> Any:
    """The datasets whose shards, or whose tokenizer, are the stored object ``sha256``."""
    # A tokenizer counts only for a dataset it made: a failed upload's name for one proves nothing.
    made = Q(tokenizer_sha256=sha256, status=Dataset.Status.READY)
    return Dataset.objects.filter(Q(shards__sha256=sha256) | made).distinct()
