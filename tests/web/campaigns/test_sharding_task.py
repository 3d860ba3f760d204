"""The sharding task: each format, each bad file with its message, the validation split, and dedupe."""

from __future__ import annotations

import io
import json
import zipfile
from typing import Any

import numpy as np
import pytest
from django.contrib.auth import get_user_model
from django.core.files.storage import default_storage

from crowdtrain.datasets import sharding, tasks
from crowdtrain.datasets.models import Dataset, Shard, Upload, shard_table
from crowdtrain.datasets.sharding import DatasetError, create_npz_dataset
from crowdtrain.datasets.uploads import append_chunk, complete_upload
from crowdtrain_agent.data import ShardReader
from crowdtrain_agent.protocol import DataSpec
from tests.factories import make_organizer

pytestmark = pytest.mark.django_db

TEXT = bytes(32 + (i * 13 + 5) % 95 for i in range(1000))


@pytest.fixture(autouse=True)
def five_percent_held_out(settings: Any) -> None:
    settings.CROWDTRAIN_VALIDATION_FRACTION = 0.05
    settings.CROWDTRAIN_SHARD_BYTES = 1024


def _npz(compressed: bool = False, **arrays: Any) -> bytes:
    buffer = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buffer, **arrays)
    return buffer.getvalue()


def _organizer(name: str) -> Any:
    return get_user_model().objects.filter(username=name).first() or make_organizer(name)


def _upload(data: bytes, fmt: str = "text", owner: Any = None, chunk: int = 300, **fields: Any) -> Dataset:
    """Send ``data`` in chunks, complete, and return the dataset as the (eager) task left it."""
    options: dict[str, Any] = {"sample_len": 10 if fmt != "npz" else 0, **fields}
    upload = Upload.objects.create(
        owner=owner or _organizer("olga"), name="d", filename=f"d.{fmt}", size=len(data), format=fmt, **options
    )
    for offset in range(0, len(data), chunk):
        upload = append_chunk(upload, offset, data[offset : offset + chunk])
    upload = complete_upload(upload)
    return Dataset.objects.get(pk=upload.dataset_id)


def _bytes_of(shards: Any) -> bytes:
    return b"".join(default_storage.open(s.storage_name).read() for s in shards)


def test_a_text_file_becomes_training_shards_and_a_held_out_tail() -> None:
    dataset = _upload(TEXT)

    assert dataset.status == "ready" and dataset.progress == 1.0 and dataset.error == ""
    assert (dataset.num_samples, dataset.num_validation_samples) == (95, 5)
    assert _bytes_of(dataset.train_shards()) == TEXT[:950]
    assert _bytes_of(dataset.validation_shards()) == TEXT[950:]
    assert [s.first_sample for s in dataset.validation_shards()] == [0]


def test_the_scheduler_sees_only_the_training_shards() -> None:
    dataset = _upload(TEXT)

    table = shard_table(dataset)

    assert table.sha256s == tuple(dataset.train_shards().values_list("sha256", flat=True))
    assert sum(table.sizes) == dataset.num_samples == 95


def test_a_ragged_tail_shorter_than_a_sample_is_dropped() -> None:
    dataset = _upload(TEXT + b"12345")

    assert dataset.num_samples + dataset.num_validation_samples == 100


@pytest.mark.parametrize(("size", "split"), [(30, (2, 1)), (200, (19, 1)), (1000, (95, 5)), (4000, (380, 20))])
def test_the_validation_split_is_a_fraction_with_at_least_one_sample(size: int, split: tuple[int, int]) -> None:
    dataset = _upload((TEXT * 4)[:size])

    assert (dataset.num_samples, dataset.num_validation_samples) == split


def test_no_validation_split_when_the_fraction_is_zero(settings: Any) -> None:
    settings.CROWDTRAIN_VALIDATION_FRACTION = 0.0

    dataset = _upload(TEXT)

    assert (dataset.num_samples, dataset.num_validation_samples) == (100, 0)
    assert not dataset.validation_shards().exists()


def test_jsonl_texts_are_joined_by_a_blank_line_into_one_corpus() -> None:
    lines = [{"body": "x" * 40, "id": 1}, {"body": "é" * 30}, {"body": "z" * 41}]
    data = "\n".join(json.dumps(line) for line in lines).encode() + b"\n\n"
    corpus = ("x" * 40 + "\n\n" + "é" * 30 + "\n\n" + "z" * 41).encode()

    dataset = _upload(data, "jsonl", text_field="body")

    assert dataset.status == "ready", dataset.error
    assert dataset.kind == "text"
    assert (dataset.num_samples, dataset.num_validation_samples) == (13, 1)  # 145 bytes: 14 samples
    assert _bytes_of(dataset.train_shards()) + _bytes_of(dataset.validation_shards()) == corpus[:140]


@pytest.mark.parametrize("compressed", [False, True])
def test_an_npz_streams_into_tensor_shards_with_held_out_rows(compressed: bool) -> None:
    x = np.random.default_rng(0).normal(size=(200, 3)).astype(np.float64)
    y = np.arange(200) % 4

    dataset = _upload(_npz(compressed, x=x, y=y), "npz")

    assert dataset.status == "ready", dataset.error
    assert dataset.kind == "tensors"
    assert (dataset.num_samples, dataset.num_validation_samples) == (190, 10)
    assert dataset.train_shards().count() > 1
    spec = DataSpec(kind="tensors", sample_len=0)
    held_out = [ShardReader(spec, default_storage.open(s.storage_name).read()) for s in dataset.validation_shards()]
    vx, vy = held_out[0].read(0, 10)
    np.testing.assert_allclose(vx.numpy(), x[190:].astype(np.float32))
    assert vy.tolist() == y[190:].tolist()


def _zeros_npz() -> bytes:
    return _npz(True, x=np.zeros((4000, 8), dtype=np.float32), y=np.zeros(4000, dtype=np.int64))


BAD_FILES = [
    ("text", b"abc\0def" * 10, "byte 3 is a NUL byte: this looks like a binary file"),
    ("text", b"short", "text of 5 bytes is shorter than one sample of 10 bytes"),
    ("text", b"0123456789abc", "the data holds 1 sample(s); at least 2 are needed"),
    ("jsonl", b'{"text": "ok"}\n{"text": oops}\n', "line 2 is not valid JSON"),
    ("jsonl", b'["a list"]\n', "line 1 is not a JSON object but list"),
    ("jsonl", b'{"body": "hello"}\n', "line 1 has no 'text' field; its fields are ['body']"),
    ("jsonl", b'{"text": 42}\n', "line 1: field 'text' must be a string, got int"),
    ("jsonl", b"\n  \n\n", "the file holds no JSON line with a 'text' field"),
    ("jsonl", b'{"text": "tiny"}\n', "the joined texts (4 bytes) is shorter than one sample of 10 bytes"),
    ("npz", b"this is not a zip archive at all", "not a readable .npz file"),
    ("npz", _npz(x=np.zeros((3, 2))), r"npz file lacks array(s) y; it has ['x']"),
    ("npz", _npz(x=np.zeros((3, 2)), y=np.zeros(4, dtype=np.int64)), "x has 3 rows but y has 4; they must match"),
    ("npz", _npz(x=np.array([["a"], ["b"]]), y=np.zeros(2, dtype=np.int64)), "x must be numeric and y integer"),
    ("npz", _npz(x=np.zeros((3, 2)), y=np.zeros(3)), "x must be numeric and y integer class labels"),
    ("npz", _npz(x=np.zeros((2, 2)), y=np.zeros((2, 2), dtype=np.int64)), "y must hold one class label per row"),
    ("npz", _npz(x=np.zeros((0, 2)), y=np.zeros(0, dtype=np.int64)), "must each hold at least one row"),
    ("npz", _npz(x=np.array([[1.0], [np.inf]]), y=np.arange(2)), "NaN or infinite values (first in row 1)"),
    ("npz", _npz(x=np.zeros((1, 2)), y=np.zeros(1, dtype=np.int64)), "at least 2 are needed"),
]


@pytest.mark.parametrize(("fmt", "data", "problem"), BAD_FILES)
def test_a_bad_file_fails_with_a_message_and_leaves_no_shards(fmt: str, data: bytes, problem: str) -> None:
    dataset = _upload(data, fmt)

    assert dataset.status == "failed"
    assert problem in dataset.error
    assert not Shard.objects.exists()
    assert not Upload.objects.get(dataset=dataset).chunks.exists()


def test_an_npz_that_unpacks_past_the_size_cap_is_refused(settings: Any) -> None:
    data = _zeros_npz()
    settings.CROWDTRAIN_MAX_UPLOAD_BYTES = len(data) + 1000  # the upload fits, its 160 kB of arrays do not

    dataset = _upload(data, "npz", chunk=4096)

    assert dataset.status == "failed"
    assert "hold 160000 bytes uncompressed, over the limit" in dataset.error


def test_a_truncated_npz_member_is_reported_as_damaged() -> None:
    good = _npz(x=np.zeros((50, 4)), y=np.zeros(50, dtype=np.int64))
    archive = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(good)) as source, zipfile.ZipFile(archive, "w") as target:
        target.writestr("x.npy", source.read("x.npy")[:-100])
        target.writestr("y.npy", source.read("y.npy"))

    dataset = _upload(archive.getvalue(), "npz", chunk=4096)

    assert dataset.status == "failed"
    assert "array x is truncated" in dataset.error


def test_a_file_whose_sha256_differs_from_the_declared_one_fails() -> None:
    dataset = _upload(TEXT, sha256="0" * 64)

    assert dataset.status == "failed"
    assert f"the file's sha256 is {dataset.source_sha256} but the upload declared {'0' * 64}" in dataset.error


def test_an_empty_source_is_refused() -> None:
    with pytest.raises(DatasetError, match="the file is empty"):
        create_npz_dataset("empty", b"")


def test_the_same_file_uploaded_twice_is_sharded_once_and_stored_once(monkeypatch: pytest.MonkeyPatch) -> None:
    first = _upload(TEXT)
    stored = default_storage.listdir("shards")
    monkeypatch.setattr(tasks, "shard_source", lambda *a, **k: pytest.fail("the second upload was sharded again"))

    second = _upload(TEXT, owner=make_organizer("sam"))

    assert second.status == "ready" and second.owner.username == "sam"
    assert second.pk != first.pk and second.source_sha256 == first.source_sha256
    assert list(second.shards.values_list("split", "sha256")) == list(first.shards.values_list("split", "sha256"))
    assert default_storage.listdir("shards") == stored


def test_a_different_sample_length_is_a_different_dataset() -> None:
    first = _upload(TEXT)

    second = _upload(TEXT, sample_len=20)

    assert second.num_samples + second.num_validation_samples == 50
    assert first.num_samples + first.num_validation_samples == 100


def test_progress_rises_to_one_while_sharding(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[float] = []
    original = tasks._Progress.__call__

    def spy(self: Any, fraction: float) -> None:
        seen.append(self.start + (self.end - self.start) * fraction)
        original(self, fraction)

    monkeypatch.setattr(tasks._Progress, "__call__", spy)

    _upload(TEXT * 20, chunk=5000)

    assert len(seen) > 5
    assert seen == sorted(seen) and seen[-1] == pytest.approx(1.0)


def test_the_task_is_idempotent_and_skips_vanished_uploads() -> None:
    dataset = _upload(TEXT)
    upload = Upload.objects.get(dataset=dataset)
    shards = list(dataset.shards.values_list("sha256", flat=True))

    again = tasks.shard_upload(str(upload.pk))
    vanished = tasks.shard_upload("00000000-0000-0000-0000-000000000000")

    assert again == "ready" and vanished is None
    assert list(dataset.shards.values_list("sha256", flat=True)) == shards


def test_text_blocks_are_cut_the_same_however_the_stream_is_split() -> None:
    whole = list(sharding.text_pieces([TEXT], 10, 7, 90, 10))

    pieces = list(sharding.text_pieces((TEXT[i : i + 3] for i in range(0, len(TEXT), 3)), 10, 7, 90, 10))

    assert pieces == whole
    assert [p[0] for p in pieces].count("validation") == 2
