"""Sharding streams: a file many times the shard size never sits in memory whole."""

from __future__ import annotations

import io
import tracemalloc
from typing import Any

import numpy as np
import pytest

from crowdtrain.datasets.models import Dataset, Upload
from crowdtrain.datasets.tasks import shard_upload
from crowdtrain.datasets.uploads import append_chunk
from tests.factories import make_organizer

pytestmark = pytest.mark.django_db

MB = 1 << 20


def _received(data: bytes, fmt: str, **fields: Any) -> Upload:
    upload = Upload.objects.create(
        owner=make_organizer(f"olga-{fmt}"), name=fmt, filename=f"big.{fmt}", size=len(data), format=fmt, **fields
    )
    for offset in range(0, len(data), 8 * MB):
        upload = append_chunk(upload, offset, data[offset : offset + 8 * MB])
    dataset = Dataset.objects.create(
        name=fmt, owner=upload.owner, kind="text", source_format=fmt, sample_len=fields.get("sample_len", 0),
        validation_fraction=0.05, status="pending", progress=0.0,
    )  # fmt: skip
    Upload.objects.filter(pk=upload.pk).update(dataset=dataset, state="complete")
    return upload


def _peak_while_sharding(upload: Upload) -> int:
    tracemalloc.start()
    try:
        assert shard_upload(str(upload.pk)) == "ready", Dataset.objects.get(uploads=upload).error
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _upload_of(fmt: str) -> Upload:
    """40 MB of text, or an npz holding 40 MB of arrays, received in 8 MB chunks."""
    if fmt == "text":
        return _received((b"0123456789abcdef" * (MB // 16)) * 40, "text", sample_len=64)
    buffer = io.BytesIO()
    rows = 40 * MB // 68
    np.savez(buffer, x=np.ones((rows, 16), dtype=np.float32), y=np.zeros(rows, dtype=np.int32))
    return _received(buffer.getvalue(), "npz")


@pytest.mark.parametrize("fmt", ["text", "npz"])
def test_a_file_twenty_times_the_shard_size_is_sharded_in_bounded_memory(settings: Any, fmt: str) -> None:
    settings.CROWDTRAIN_SHARD_BYTES = 2 * MB
    upload = _upload_of(fmt)

    peak = _peak_while_sharding(upload)

    assert peak < 16 * MB, f"sharding a 40 MB {fmt} file peaked at {peak / MB:.1f} MB"
