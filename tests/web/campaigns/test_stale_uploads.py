"""Unfinished uploads past their expiry are deleted with their stored chunks; fresh and finished ones stay."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.core.files.storage import default_storage
from django.utils import timezone

from crowdtrain.datasets.models import Upload
from crowdtrain.datasets.tasks import discard_stale_uploads
from crowdtrain.datasets.uploads import append_chunk
from tests.factories import make_organizer

pytestmark = pytest.mark.django_db


def _upload(owner: Any, age_days: float, state: str = "receiving") -> Upload:
    upload = Upload.objects.create(owner=owner, name="u", filename="u.txt", size=100, format="text", sample_len=10)
    upload = append_chunk(upload, 0, b"x" * 40)
    Upload.objects.filter(pk=upload.pk).update(created_at=timezone.now() - timedelta(days=age_days), state=state)
    return upload


def test_it_deletes_only_unfinished_uploads_past_their_expiry(settings: Any) -> None:
    settings.CROWDTRAIN_UPLOAD_EXPIRY_S = 86400
    olga = make_organizer("olga")
    stale, fresh, finished = _upload(olga, 2), _upload(olga, 0.5), _upload(olga, 2, state="complete")
    stale_chunk = stale.chunks.get().name

    discarded = discard_stale_uploads()

    assert discarded == 1
    assert set(Upload.objects.values_list("pk", flat=True)) == {fresh.pk, finished.pk}
    assert not default_storage.exists(stale_chunk)
    assert default_storage.exists(fresh.chunks.get().name)
