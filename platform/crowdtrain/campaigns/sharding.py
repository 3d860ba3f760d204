"""Turn a corpus into a Dataset of content-addressed shards in the configured storage."""

from __future__ import annotations

import hashlib
import io
import logging
import sysconfig
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from django.core.files.base import ContentFile
from django.core.files.storage import default_storage
from django.db import transaction

from crowdtrain_agent.data import make_tensor_shards, make_text_shards, sha256_hex

from .models import Dataset, Shard, shard_storage_name

logger = logging.getLogger(__name__)

DEFAULT_SHARD_BYTES = 4 << 20


class DatasetError(ValueError):
    """An input that cannot become a dataset; the message says what is wrong with it."""


def _store(shard: bytes) -> str:
    """Write a shard once: identical bytes from any dataset share one stored file."""
    sha = sha256_hex(shard)
    name = shard_storage_name(sha)
    if not default_storage.exists(name):
        default_storage.save(name, ContentFile(shard))
    return sha


@transaction.atomic
def _create(name: str, kind: str, sample_len: int, source_sha: str, shards: Iterable[tuple[bytes, int]]) -> Dataset:
    dataset = Dataset.objects.create(name=name, kind=kind, sample_len=sample_len, source_sha256=source_sha)
    first = 0
    for index, (data, count) in enumerate(shards):
        Shard.objects.create(
            dataset=dataset, index=index, sha256=_store(data), first_sample=first, num_samples=count, size_bytes=len(data)
        )
        first += count
        dataset.size_bytes += len(data)
    if first == 0:
        raise DatasetError(f"dataset {name!r} holds no complete sample; upload more data")
    dataset.num_samples = first
    dataset.save(update_fields=["num_samples", "size_bytes"])
    logger.info("dataset %s: %d samples in %d shards", name, first, dataset.shards.count())
    return dataset


def create_text_dataset(name: str, text: bytes, sample_len: int, shard_bytes: int = DEFAULT_SHARD_BYTES) -> Dataset:
    """A byte-level dataset: ``sample_len`` consecutive bytes per sample.

    Raises:
        DatasetError: if the text is shorter than one sample.
    """
    if len(text) < sample_len:
        raise DatasetError(f"text of {len(text)} bytes is shorter than one sample of {sample_len} bytes")
    per_shard = max(1, shard_bytes // sample_len)
    source = hashlib.sha256(text).hexdigest()
    return _create(name, Dataset.Kind.TEXT, sample_len, source, make_text_shards(text, sample_len, per_shard))


def create_tensor_dataset(name: str, x: np.ndarray, y: np.ndarray, shard_bytes: int = DEFAULT_SHARD_BYTES) -> Dataset:
    """A dataset of feature rows ``x`` and labels ``y``.

    Raises:
        DatasetError: for mismatched, empty, non-numeric or non-finite arrays.
    """
    if x.ndim < 1 or y.ndim < 1 or len(x) == 0:
        raise DatasetError("arrays x and y must each hold at least one row")
    if len(x) != len(y):
        raise DatasetError(f"x has {len(x)} rows but y has {len(y)}; they must match")
    if x.dtype.kind not in "fiu" or y.dtype.kind not in "iu":
        raise DatasetError(f"x must be numeric and y integer class labels, got {x.dtype} and {y.dtype}")
    if x.dtype.kind == "f" and not np.isfinite(x).all():
        raise DatasetError("x contains NaN or infinite values")
    x = x.astype(np.float32) if x.dtype.kind == "f" else x
    row_bytes = max(1, x[0].nbytes + y[0].nbytes)
    source = hashlib.sha256(x.tobytes() + y.tobytes()).hexdigest()
    return _create(name, Dataset.Kind.TENSORS, 0, source, make_tensor_shards(x, y, max(1, shard_bytes // row_bytes)))


def create_npz_dataset(name: str, data: bytes, shard_bytes: int = DEFAULT_SHARD_BYTES) -> Dataset:
    """A dataset from an ``.npz`` file with arrays ``x`` and ``y`` (pickles refused).

    Raises:
        DatasetError: if the file is not an npz, or lacks x or y.
    """
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            missing = {"x", "y"} - set(npz.files)
            if missing:
                raise DatasetError(f"npz file lacks array(s) {', '.join(sorted(missing))}; it has {npz.files}")
            x, y = npz["x"], npz["y"]
    except DatasetError:
        raise
    except Exception as exc:  # numpy raises several types for corrupt archives
        raise DatasetError(f"not a readable .npz file: {exc}") from None
    return create_tensor_dataset(name, x, y, shard_bytes)


def stdlib_corpus(max_bytes: int) -> bytes:
    """The Python standard library's own source, in sorted path order: a real corpus, no download.

    Third-party packages and tests are left out, so the text is the same on
    every machine with the same Python version.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[bytes] = []
    total = 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if rel[0] in {"site-packages", "test", "idlelib", "lib2to3"} or "tests" in rel:
            continue
        data = path.read_bytes()
        parts.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(parts)[:max_bytes]
