from __future__ import annotations

import hashlib

import pytest
from django.test import Client
from django.utils import timezone

from tests.factories import make_device, make_text_dataset

pytestmark = pytest.mark.django_db


def _get(client: Client, sha: str, token: str | None, **headers: str):  # type: ignore[no-untyped-def]
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return client.get(f"/api/shards/{sha}", headers=headers)


def test_an_agent_downloads_a_shard_whose_bytes_match_its_name(client: Client) -> None:
    shard = make_text_dataset().shards.first()
    _, token = make_device()

    response = _get(client, shard.sha256, token)

    body = b"".join(response.streaming_content)
    assert response.status_code == 200
    assert hashlib.sha256(body).hexdigest() == shard.sha256
    assert response["ETag"] == f'"{shard.sha256}"'
    assert "immutable" in response["Cache-Control"]


def test_a_cached_copy_is_revalidated_without_a_body(client: Client) -> None:
    shard = make_text_dataset().shards.first()
    _, token = make_device()

    response = _get(client, shard.sha256, token, If_None_Match=f'"{shard.sha256}"')

    assert response.status_code == 304


@pytest.mark.parametrize(
    ("header", "expected"), [("bytes=0-3", (0, 4)), ("bytes=10-", (10, None)), ("bytes=-5", (-5, None))]
)
def test_it_serves_byte_ranges(client: Client, header: str, expected: tuple[int, int | None]) -> None:
    shard = make_text_dataset().shards.first()
    _, token = make_device()
    full = b"".join(_get(client, shard.sha256, token).streaming_content)

    response = _get(client, shard.sha256, token, Range=header)

    assert response.status_code == 206
    assert response.content == full[expected[0] : expected[1]]
    assert response["Content-Range"].endswith(f"/{len(full)}")


def test_an_unsatisfiable_range_gets_416(client: Client) -> None:
    shard = make_text_dataset().shards.first()
    _, token = make_device()

    response = _get(client, shard.sha256, token, Range="bytes=999999-")

    assert response.status_code == 416


def test_a_range_with_a_number_too_long_for_any_file_is_ignored_not_a_crash(client: Client) -> None:
    shard = make_text_dataset().shards.first()
    _, token = make_device()

    response = _get(client, shard.sha256, token, Range="bytes=0-" + "9" * 5000)

    assert response.status_code == 200  # an unusable Range header is ignored, as RFC 9110 allows


def test_it_refuses_without_a_valid_device_token(client: Client) -> None:
    shard = make_text_dataset().shards.first()
    device, token = make_device()
    device.revoked_at = timezone.now()
    device.save()

    anonymous = _get(client, shard.sha256, None)
    revoked = _get(client, shard.sha256, token)

    assert anonymous.status_code == revoked.status_code == 401
    assert anonymous.json() == {"error": "invalid or revoked device token"}


@pytest.mark.parametrize("name", ["0" * 64, "not-a-hash", "../../etc/passwd"])
def test_it_answers_404_for_unknown_shards(client: Client, name: str) -> None:
    _, token = make_device()

    response = _get(client, name, token)

    assert response.status_code == 404
