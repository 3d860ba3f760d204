"""Dataset pages: the uploader, the list and the live status, each for its owner (and staff) only."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from crowdtrain.datasets.models import Dataset, Upload
from crowdtrain.datasets.sharding import create_text_dataset
from tests.factories import logged_in, make_admin, make_organizer, make_volunteer

pytestmark = pytest.mark.django_db


def _dataset(owner: Any, name: str = "owned") -> Dataset:
    return create_text_dataset(name, b"abcdefghij" * 30, 10, owner=owner, validation_fraction=0.1)


def test_the_upload_page_has_the_chunked_uploader() -> None:
    response = logged_in(make_organizer("olga")).get("/datasets/new")

    assert response.status_code == 200
    assert b'data-create-url="/datasets/uploads"' in response.content
    assert b"js/upload.js" in response.content
    assert b'<option value="jsonl">' in response.content


def test_anonymous_visitors_are_sent_to_log_in_and_volunteers_are_refused() -> None:
    anonymous = Client().get("/datasets/new")
    volunteer = logged_in(make_volunteer("vera"))

    assert anonymous.status_code == 302 and anonymous["Location"].startswith("/accounts/login/")
    assert volunteer.get("/datasets/new").status_code == 403
    assert volunteer.get("/datasets/").status_code == 403
    assert volunteer.get("/datasets/1/status").json() == {"error": "only organizers can see datasets"}


def test_an_organizer_lists_only_their_datasets_and_unfinished_uploads() -> None:
    olga, sam = make_organizer("olga"), make_organizer("sam")
    _dataset(olga, "olga's corpus")
    _dataset(sam, "sam's corpus")
    Upload.objects.create(owner=olga, name="big", filename="big.txt", size=10_000, format="text", received=4096)

    page = logged_in(olga).get("/datasets/").content.decode()

    assert "olga&#x27;s corpus" in page and "sam&#x27;s corpus" not in page
    assert "big.txt" in page


def test_staff_see_every_dataset() -> None:
    _dataset(make_organizer("olga"), "olga's corpus")

    page = logged_in(make_admin()).get("/datasets/").content.decode()

    assert "olga&#x27;s corpus" in page


def test_the_status_feed_reports_the_splits_and_the_error() -> None:
    olga = make_organizer("olga")
    dataset = _dataset(olga)
    Dataset.objects.filter(pk=dataset.pk).update(status="failed", error="line 2 is not valid JSON")

    status = logged_in(olga).get(f"/datasets/{dataset.pk}/status").json()

    assert status["status"] == "failed" and status["error"] == "line 2 is not valid JSON"
    assert (status["num_samples"], status["num_validation_samples"]) == (27, 3)
    assert (status["train_shards"], status["validation_shards"]) == (1, 1)


def test_someone_elses_dataset_is_unknown() -> None:
    dataset = _dataset(make_organizer("olga"))
    sam = logged_in(make_organizer("sam"))

    assert sam.get(f"/datasets/{dataset.pk}/").status_code == 404
    assert sam.get(f"/datasets/{dataset.pk}/status").status_code == 404


def test_the_detail_page_polls_while_sharding() -> None:
    olga = make_organizer("olga")
    dataset = _dataset(olga)
    Dataset.objects.filter(pk=dataset.pk).update(status="sharding", progress=0.4)

    page = logged_in(olga).get(f"/datasets/{dataset.pk}/").content.decode()

    assert f'data-status-url="/datasets/{dataset.pk}/status"' in page
    assert 'data-state="sharding"' in page and "40%" in page
