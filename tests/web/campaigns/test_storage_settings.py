"""Storage: the media folder by default, S3 when CROWDTRAIN_S3_BUCKET is set; all I/O through default_storage."""

from __future__ import annotations

import importlib.util
import json
import sys
from types import ModuleType
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import Client, override_settings
from storages.backends.s3 import S3Storage

import crowdtrain.settings
from crowdtrain.datasets.models import Dataset
from tests.factories import logged_in, make_device, make_organizer

S3_VARIABLES = {
    "CROWDTRAIN_S3_BUCKET": "crowdtrain-data",
    "CROWDTRAIN_S3_ENDPOINT_URL": "https://s3.example.org",
    "CROWDTRAIN_S3_ACCESS_KEY_ID": "AKIAEXAMPLE",
    "CROWDTRAIN_S3_SECRET_ACCESS_KEY": "secret-example",
    "CROWDTRAIN_S3_REGION": "eu-central-1",
}


def _settings_with(monkeypatch: pytest.MonkeyPatch, **env: str) -> ModuleType:
    """Run settings.py again, as a fresh process would with these variables, without touching the live settings."""
    for name in S3_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    spec = importlib.util.spec_from_file_location("crowdtrain.settings_probe", crowdtrain.settings.__file__)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "crowdtrain.settings_probe", module)
    spec.loader.exec_module(module)
    return module


def test_the_default_storage_is_the_media_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    probe = _settings_with(monkeypatch)

    assert probe.STORAGES["default"] == {"BACKEND": "django.core.files.storage.FileSystemStorage"}


def test_a_bucket_switches_the_default_storage_to_s3(monkeypatch: pytest.MonkeyPatch) -> None:
    probe = _settings_with(monkeypatch, **S3_VARIABLES)

    default = probe.STORAGES["default"]
    storage = S3Storage(**default["OPTIONS"])  # builds no connection until the first request

    assert default["BACKEND"] == "storages.backends.s3.S3Storage"
    assert (storage.bucket_name, storage.endpoint_url, storage.region_name) == (
        "crowdtrain-data", "https://s3.example.org", "eu-central-1",
    )  # fmt: skip
    assert (storage.access_key, storage.secret_key) == ("AKIAEXAMPLE", "secret-example")
    assert storage.default_acl is None and storage.file_overwrite


def test_unset_s3_credentials_are_left_to_boto3(monkeypatch: pytest.MonkeyPatch) -> None:
    probe = _settings_with(monkeypatch, CROWDTRAIN_S3_BUCKET="only-a-bucket")

    options = probe.STORAGES["default"]["OPTIONS"]

    assert options["bucket_name"] == "only-a-bucket"
    assert options["endpoint_url"] is options["access_key"] is options["secret_key"] is options["region_name"] is None


@pytest.mark.parametrize(("raw", "problem"), [("0.5", "below 0.5"), ("-0.1", "at least 0.0"), ("x", "a number")])
def test_a_bad_validation_fraction_stops_start_up(monkeypatch: pytest.MonkeyPatch, raw: str, problem: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=problem) as info:
        _settings_with(monkeypatch, CROWDTRAIN_VALIDATION_FRACTION=raw)

    assert "CROWDTRAIN_VALIDATION_FRACTION" in str(info.value)


IN_MEMORY = {
    "default": {"BACKEND": "django.core.files.storage.InMemoryStorage"},
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
}


@pytest.mark.django_db
@override_settings(STORAGES=IN_MEMORY, CROWDTRAIN_UPLOAD_CHUNK_BYTES=1024)
def test_upload_sharding_and_download_use_only_the_storage_api(media_root: Any) -> None:
    # A storage with no files on disk stands in for S3: any code that used a path would fail here.
    corpus = bytes(32 + (i * 17) % 95 for i in range(2500))
    client = logged_in(make_organizer("olga"))
    body = {"filename": "c.txt", "size": len(corpus), "format": "text", "sample_len": 10}
    upload_id = client.post("/datasets/uploads", json.dumps(body), content_type="application/json").json()["id"]
    for offset in range(0, len(corpus), 1024):
        client.put(f"/datasets/uploads/{upload_id}/chunk?offset={offset}", corpus[offset : offset + 1024],
                   content_type="application/octet-stream")  # fmt: skip
    dataset_id = client.post(f"/datasets/uploads/{upload_id}/complete").json()["dataset"]
    shard = Dataset.objects.get(pk=dataset_id).train_shards().first()
    _, token = make_device("vera")

    response = Client().get(
        f"/api/shards/{shard.sha256}", headers={"Authorization": f"Bearer {token}", "Range": "bytes=0-9"}
    )

    assert Dataset.objects.get(pk=dataset_id).status == "ready"
    assert not any(media_root.rglob("*")), "something was written to the media folder"
    assert response.status_code == 206 and response.content == corpus[:10]
