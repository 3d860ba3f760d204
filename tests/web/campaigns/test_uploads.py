"""The chunked upload API: resume points, refusals with their status codes, and who may touch an upload."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from django.core.files.storage import default_storage
from django.test import Client

from crowdtrain.datasets.models import Dataset, Upload
from tests.factories import logged_in, make_admin, make_organizer, make_volunteer

pytestmark = pytest.mark.django_db

CORPUS = bytes(32 + (i * 31 + 7) % 95 for i in range(3000))


@pytest.fixture(autouse=True)
def small_chunks(settings: Any) -> None:
    settings.CROWDTRAIN_UPLOAD_CHUNK_BYTES = 1024


def _start(client: Client, **fields: Any) -> Any:
    body = {"filename": "corpus.txt", "size": len(CORPUS), "format": "text", "sample_len": 10, **fields}
    return client.post("/datasets/uploads", json.dumps(body), content_type="application/json")


def _put(client: Client, upload_id: str, offset: int | str, data: bytes) -> Any:
    return client.put(
        f"/datasets/uploads/{upload_id}/chunk?offset={offset}", data, content_type="application/octet-stream"
    )


def _send_all(client: Client, upload_id: str, data: bytes, chunk: int = 1024) -> None:
    for offset in range(0, len(data), chunk):
        assert _put(client, upload_id, offset, data[offset : offset + chunk]).status_code == 200


def test_an_organizer_uploads_in_chunks_and_completing_shards_the_file() -> None:
    client = logged_in(make_organizer("olga"))
    upload_id = _start(client).json()["id"]
    _send_all(client, upload_id, CORPUS)

    response = client.post(f"/datasets/uploads/{upload_id}/complete")

    dataset = Dataset.objects.get(pk=response.json()["dataset"])
    assert response.status_code == 202
    assert dataset.status == "ready" and dataset.owner.username == "olga"
    assert dataset.num_samples + dataset.num_validation_samples == len(CORPUS) // 10
    assert response.json()["dataset_url"] == f"/datasets/{dataset.pk}/"
    assert not default_storage.exists(f"uploads/{upload_id}/") or not default_storage.listdir(f"uploads/{upload_id}")[1]


def test_the_upload_says_how_many_bytes_arrived_so_a_reload_can_resume() -> None:
    client = logged_in(make_organizer("olga"))
    upload_id = _start(client).json()["id"]
    _put(client, upload_id, 0, CORPUS[:1024])
    _put(client, upload_id, 1024, CORPUS[1024:1500])

    response = client.get(f"/datasets/uploads/{upload_id}")

    assert response.status_code == 200
    assert response.json()["received"] == 1500
    assert response.json()["state"] == "receiving"


@pytest.mark.parametrize("offset", [0, 700, 2048])
def test_a_chunk_at_the_wrong_offset_gets_409_with_the_resume_point(offset: int) -> None:
    client = logged_in(make_organizer("olga"))
    upload_id = _start(client).json()["id"]
    _put(client, upload_id, 0, CORPUS[:1024])

    response = _put(client, upload_id, offset, CORPUS[offset : offset + 100])

    assert response.status_code == 409
    assert response.json()["expected_offset"] == 1024
    assert f"offset {offset} is not the resume point 1024" in response.json()["error"]
    assert Upload.objects.get(pk=upload_id).received == 1024


def test_a_chunk_over_the_chunk_limit_gets_413() -> None:
    client = logged_in(make_organizer("olga"))
    upload_id = _start(client).json()["id"]

    response = _put(client, upload_id, 0, CORPUS[:1025])

    assert response.status_code == 413
    assert "at most 1024 bytes" in response.json()["error"]
    assert Upload.objects.get(pk=upload_id).received == 0


def test_a_chunk_past_the_declared_size_gets_413() -> None:
    client = logged_in(make_organizer("olga"))
    upload_id = _start(client, size=100).json()["id"]

    response = _put(client, upload_id, 0, CORPUS[:200])

    assert response.status_code == 413
    assert "past the declared size of 100 bytes" in response.json()["error"]


def test_a_file_over_the_size_cap_is_refused_before_any_byte(settings: Any) -> None:
    settings.CROWDTRAIN_MAX_UPLOAD_BYTES = 2000
    client = logged_in(make_organizer("olga"))

    response = _start(client)

    assert response.status_code == 413
    assert response.json()["error"] == "the file is 3000 bytes, over the limit of 2000 bytes"
    assert not Upload.objects.exists()


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"format": "csv"}, "unknown format 'csv'; expected one of text, npz, jsonl"),
        ({"size": 0}, "the file is empty"),
        ({"size": "12"}, "size must be an integer, got '12'"),
        ({"size": True}, "size must be an integer, got True"),
        ({"size": None}, "size is required"),
        ({"filename": ""}, "filename must hold 1 to 255 characters"),
        ({"sha256": "abc"}, "sha256 must be 64 hexadecimal digits"),
        ({"sample_len": 1}, "sample_len must be between 2 and 8193 bytes"),
        ({"sample_len": None}, "sample_len is required"),
        ({"format": "jsonl", "text_field": " "}, "text_field must hold 1 to 100 characters"),
    ],
)
def test_a_bad_upload_request_is_refused_with_the_field_named(fields: dict[str, Any], problem: str) -> None:
    client = logged_in(make_organizer("olga"))

    response = _start(client, **fields)

    assert response.status_code == 400
    assert problem in response.json()["error"]
    assert not Upload.objects.exists()


def test_optional_fields_may_be_null() -> None:
    client = logged_in(make_organizer("olga"))

    response = _start(client, sha256=None, name=None, format="jsonl", text_field=None)

    assert response.status_code == 201
    upload = Upload.objects.get()
    assert (upload.sha256, upload.name, upload.text_field) == ("", "corpus", "text")


def test_a_body_that_is_not_json_is_refused() -> None:
    client = logged_in(make_organizer("olga"))

    response = client.post("/datasets/uploads", "size=3", content_type="application/json")

    assert response.status_code == 400
    assert response.json() == {"error": "the request body must be a JSON object"}


@pytest.mark.parametrize("offset", ["", "-1", "ten"])
def test_a_chunk_without_a_byte_offset_is_refused(offset: str) -> None:
    client = logged_in(make_organizer("olga"))
    upload_id = _start(client).json()["id"]

    response = _put(client, upload_id, offset, CORPUS[:10])

    assert response.status_code == 400
    assert "offset must be a byte position" in response.json()["error"]


def test_completing_before_every_byte_arrived_gets_409() -> None:
    client = logged_in(make_organizer("olga"))
    upload_id = _start(client).json()["id"]
    _put(client, upload_id, 0, CORPUS[:1024])

    response = client.post(f"/datasets/uploads/{upload_id}/complete")

    assert response.status_code == 409
    assert response.json()["error"] == "received 1024 of 3000 bytes; send the rest first"
    assert not Dataset.objects.exists()


def test_completing_twice_gives_the_same_dataset_and_refuses_more_chunks() -> None:
    client = logged_in(make_organizer("olga"))
    upload_id = _start(client).json()["id"]
    _send_all(client, upload_id, CORPUS)
    first = client.post(f"/datasets/uploads/{upload_id}/complete").json()["dataset"]

    again = client.post(f"/datasets/uploads/{upload_id}/complete")
    late_chunk = _put(client, upload_id, 3000, b"x")

    assert again.status_code == 202 and again.json()["dataset"] == first
    assert Dataset.objects.count() == 1
    assert late_chunk.status_code == 409 and late_chunk.json()["error"] == "the upload is already complete"


def test_anonymous_visitors_and_plain_volunteers_cannot_upload() -> None:
    anonymous = _start(Client())
    volunteer = _start(logged_in(make_volunteer("vera")))

    assert anonymous.status_code == 401 and anonymous.json() == {"error": "log in first"}
    assert volunteer.status_code == 403
    assert "only organizers can upload datasets" in volunteer.json()["error"]
    assert not Upload.objects.exists()


@pytest.mark.parametrize("persona", ["stranger", "admin"])
def test_someone_elses_upload_is_unknown(persona: str) -> None:
    owner = logged_in(make_organizer("olga"))
    upload_id = _start(owner).json()["id"]
    _put(owner, upload_id, 0, CORPUS[:1024])
    other = logged_in(make_organizer("sam") if persona == "stranger" else make_admin())

    answers = [
        other.get(f"/datasets/uploads/{upload_id}"),
        _put(other, upload_id, 1024, CORPUS[1024:2048]),
        other.post(f"/datasets/uploads/{upload_id}/complete"),
    ]

    assert [a.status_code for a in answers] == [404, 404, 404]
    assert answers[0].json() == {"error": "unknown upload"}
    assert Upload.objects.get(pk=upload_id).received == 1024


@pytest.mark.django_db(transaction=True)
def test_without_a_worker_the_request_returns_and_sharding_finishes_in_the_background(settings: Any) -> None:
    settings.CROWDTRAIN_EAGER_TASKS_IN_BACKGROUND = True  # the embedded default: eager Celery, no worker
    client = logged_in(make_organizer("olga"))
    upload_id = _start(client).json()["id"]
    _send_all(client, upload_id, CORPUS)

    response = client.post(f"/datasets/uploads/{upload_id}/complete")
    dataset_id = response.json()["dataset"]
    deadline = time.monotonic() + 30
    while Dataset.objects.get(pk=dataset_id).status not in ("ready", "failed") and time.monotonic() < deadline:
        time.sleep(0.05)

    assert response.status_code == 202
    assert Dataset.objects.get(pk=dataset_id).status == "ready"
    assert client.get(f"/datasets/{dataset_id}/status").json()["status"] == "ready"


@pytest.mark.parametrize("offset", ["%C2%B2", "1" * 40, "-1"])
def test_an_offset_that_is_not_plain_digits_is_a_clear_400(offset: str) -> None:
    client = logged_in(make_organizer("olga"))
    upload_id = _start(client).json()["id"]

    response = client.put(
        f"/datasets/uploads/{upload_id}/chunk?offset={offset}", b"x", content_type="application/octet-stream"
    )

    assert response.status_code == 400 and "offset must be a byte position" in response.json()["error"]


def test_a_create_request_nested_beyond_the_parser_is_a_clear_400() -> None:
    client = logged_in(make_organizer("olga"))

    response = client.post("/datasets/uploads", "[" * 5000, content_type="application/json")

    assert response.status_code == 400 and "JSON object" in response.json()["error"]
