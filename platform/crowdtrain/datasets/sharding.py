"""Turn a corpus into a Dataset of content-addressed shards in the configured storage, streaming.

Every input is read as a stream of blocks or rows, so a file of several GB
never sits in memory: at most one shard (``CROWDTRAIN_SHARD_BYTES``) does.
The last ``validation_fraction`` of the samples (at least one) become a
held-out validation split: shards of the same dataset with ``split =
"validation"``, never leased for training.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import sysconfig
import threading
import zipfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, BinaryIO, Protocol

import numpy as np
from django.conf import settings
from django.core.files.base import ContentFile
from django.core.files.storage import default_storage
from django.db import DatabaseError, connection, transaction
from safetensors.numpy import save as save_safetensors

from crowdtrain_agent.data import sha256_hex

from .models import Dataset, Shard, shard_storage_name

if TYPE_CHECKING:
    from django.contrib.auth.models import User

logger = logging.getLogger(__name__)

DEFAULT_SHARD_BYTES = 4 << 20
# How much of a stream one read takes: big enough to be fast, small enough to never matter.
BLOCK_BYTES = 1 << 20
# The bytes put between two JSONL texts when they are joined into one byte-level corpus.
JSONL_SEPARATOR = b"\n\n"
# A JSONL line longer than this is refused rather than read into memory whole.
MAX_JSONL_LINE_BYTES = 64 << 20

ShardPiece = tuple[str, bytes, int]  # (split, shard bytes, number of samples)
ProgressFn = Callable[[float], None]


class DatasetError(ValueError):
    """An input that cannot become a dataset; the message says what is wrong with it."""


def _no_progress(fraction: float) -> None:
    pass


def split_sizes(total: int, validation_fraction: float) -> tuple[int, int]:
    """How many of ``total`` samples train and how many are held out (the last ones).

    Raises:
        DatasetError: if a requested split would leave no training or no validation sample.
    """
    if validation_fraction <= 0:
        return total, 0
    held_out = max(1, math.floor(total * validation_fraction))
    if total - held_out < 1:
        raise DatasetError(
            f"the data holds {total} sample(s); at least 2 are needed, one to train on and one held out "
            "for validation; upload more data"
        )
    return total - held_out, held_out


def store_object(shard: bytes) -> str:
    """Write a shard (or a tokenizer) once: identical bytes from any dataset share one stored object."""
    sha = sha256_hex(shard)
    name = shard_storage_name(sha)
    if not default_storage.exists(name):
        default_storage.save(name, ContentFile(shard))
    return sha


def fill_dataset(dataset: Dataset, pieces: Iterable[ShardPiece]) -> Dataset:
    """Store each shard, then add all Shard rows and the counts in one transaction.

    Shard bytes go to storage as they come (content-addressed, so a failed run
    leaves at most unreferenced objects); the rows appear all at once, so a
    dataset is never seen half-made.

    Raises:
        DatasetError: if no training sample came out.
    """
    rows: list[Shard] = []
    counts = {Shard.Split.TRAIN.value: 0, Shard.Split.VALIDATION.value: 0}
    indexes = {Shard.Split.TRAIN.value: 0, Shard.Split.VALIDATION.value: 0}
    size = 0
    for split, data, count in pieces:
        rows.append(
            Shard(
                dataset=dataset,
                split=split,
                index=indexes[split],
                sha256=store_object(data),
                first_sample=counts[split],
                num_samples=count,
                size_bytes=len(data),
            )
        )
        indexes[split] += 1
        counts[split] += count
        size += len(data)
    if counts[Shard.Split.TRAIN] == 0:
        raise DatasetError(f"dataset {dataset.name!r} holds no complete sample; upload more data")
    with transaction.atomic():
        Shard.objects.filter(dataset=dataset).delete()  # a rerun of the task starts over
        Shard.objects.bulk_create(rows)
        dataset.num_samples = counts[Shard.Split.TRAIN]
        dataset.num_validation_samples = counts[Shard.Split.VALIDATION]
        dataset.size_bytes = size
        dataset.save(update_fields=["num_samples", "num_validation_samples", "size_bytes"])
    logger.info(
        "dataset %s: %d training and %d validation samples in %d shards",
        dataset.pk,
        dataset.num_samples,
        dataset.num_validation_samples,
        len(rows),
    )
    return dataset


# What a dataset's shards are, beside the rows: a dataset that shares them shares these.
SHARED_FIELDS = (
    "kind", "sample_len", "tokenizer_sha256", "vocab_size", "token_bytes", "image_size", "labels",
    "num_samples", "num_validation_samples", "size_bytes",
)  # fmt: skip


def copy_shards(source: Dataset, target: Dataset) -> Dataset:
    """Give ``target`` the shards of ``source``: rows only, the stored bytes are shared."""
    rows = [
        Shard(
            dataset=target,
            split=s.split,
            index=s.index,
            sha256=s.sha256,
            first_sample=s.first_sample,
            num_samples=s.num_samples,
            size_bytes=s.size_bytes,
        )
        for s in source.shards.all()
    ]
    with transaction.atomic():
        Shard.objects.filter(dataset=target).delete()
        Shard.objects.bulk_create(rows)
        for field in SHARED_FIELDS:
            setattr(target, field, getattr(source, field))
        target.save(update_fields=list(SHARED_FIELDS))
    return target


# ---------------------------------------------------------------- text


def read_blocks(fh: IO[bytes], block_bytes: int = BLOCK_BYTES) -> Iterator[bytes]:
    while block := fh.read(block_bytes):
        yield block


def text_pieces(
    blocks: Iterable[bytes], sample_len: int, samples_per_shard: int, num_train: int, num_validation: int
) -> Iterator[ShardPiece]:
    """Cut a byte stream into shards of whole samples: ``num_train`` samples, then ``num_validation`` held out.

    A shard never spans the two splits; bytes after the last sample are dropped.
    """
    if sample_len < 2:
        raise DatasetError(f"sample_len must be at least 2 bytes, got {sample_len}")
    plan = [(Shard.Split.TRAIN.value, num_train), (Shard.Split.VALIDATION.value, num_validation)]
    buffer = bytearray()
    stream = iter(blocks)
    for split, remaining in plan:
        while remaining > 0:
            want = min(samples_per_shard, remaining) * sample_len
            while len(buffer) < want:
                block = next(stream, None)
                if block is None:
                    raise DatasetError(
                        f"the text ended early: {remaining} more sample(s) of {sample_len} bytes were expected; "
                        "the file changed while it was being read"
                    )
                buffer += block
            yield split, bytes(buffer[:want]), want // sample_len
            del buffer[:want]
            remaining -= want // sample_len


def create_text_dataset(
    name: str,
    text: bytes,
    sample_len: int,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    *,
    validation_fraction: float = 0.0,
    owner: User | None = None,
) -> Dataset:
    """A byte-level dataset: ``sample_len`` consecutive bytes per sample.

    Raises:
        DatasetError: if the text is shorter than one sample (or two, with a validation split).
    """
    if len(text) < sample_len:
        raise DatasetError(f"text of {len(text)} bytes is shorter than one sample of {sample_len} bytes")
    num_train, num_validation = split_sizes(len(text) // sample_len, validation_fraction)
    per_shard = max(1, shard_bytes // sample_len)
    with transaction.atomic():
        dataset = Dataset.objects.create(
            name=name,
            owner=owner,
            kind=Dataset.Kind.TEXT,
            sample_len=sample_len,
            source_sha256=hashlib.sha256(text).hexdigest(),
            validation_fraction=validation_fraction,
        )
        return fill_dataset(dataset, text_pieces([text], sample_len, per_shard, num_train, num_validation))


# ---------------------------------------------------------------- tensors


class RowSource(Protocol):
    """Rows of ``x`` and ``y`` read front to back, a few at a time."""

    rows: int
    row_bytes: int  # of one stored row: x (as float32 if floating) plus y

    def read(self, count: int) -> tuple[np.ndarray, np.ndarray]: ...


def _check_arrays(x_shape: tuple[int, ...], x_dtype: np.dtype, y_shape: tuple[int, ...], y_dtype: np.dtype) -> None:
    if x_dtype.hasobject or y_dtype.hasobject:
        raise DatasetError("arrays x and y must be numeric; one holds Python objects (dtype object)")
    if len(x_shape) < 1 or len(y_shape) < 1 or x_shape[0] == 0:
        raise DatasetError("arrays x and y must each hold at least one row")
    if x_shape[0] != y_shape[0]:
        raise DatasetError(f"x has {x_shape[0]} rows but y has {y_shape[0]}; they must match")
    if x_dtype.kind not in "fiu" or y_dtype.kind not in "iu":
        raise DatasetError(f"x must be numeric and y integer class labels, got {x_dtype} and {y_dtype}")
    if len(y_shape) != 1:
        raise DatasetError(f"y must hold one class label per row (1-D), got shape {y_shape}")


def _stored_rows(x: np.ndarray, y: np.ndarray, first_row: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows as the shards keep them: float x as float32, native byte order, checked finite."""
    if x.dtype.kind == "f":
        if not np.isfinite(x).all():
            bad = int(np.argwhere(~np.isfinite(x.reshape(len(x), -1)).all(axis=1))[0][0])
            raise DatasetError(f"x contains NaN or infinite values (first in row {first_row + bad})")
        x = x.astype(np.float32)
    x = x.astype(x.dtype.newbyteorder("="), copy=False)
    y = y.astype(y.dtype.newbyteorder("="), copy=False)
    return np.ascontiguousarray(x), np.ascontiguousarray(y)


def _stored_row_bytes(x_shape: tuple[int, ...], x_dtype: np.dtype, y_dtype: np.dtype) -> int:
    x_item = 4 if x_dtype.kind == "f" else x_dtype.itemsize
    return max(1, math.prod(x_shape[1:]) * x_item + y_dtype.itemsize)


class ArrayRows:
    """Rows of two arrays already in memory."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        _check_arrays(x.shape, x.dtype, y.shape, y.dtype)
        self._x, self._y = x, y
        self.rows = len(x)
        self.row_bytes = _stored_row_bytes(x.shape, x.dtype, y.dtype)
        self._next = 0

    def read(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        start, self._next = self._next, self._next + count
        return _stored_rows(self._x[start : self._next], self._y[start : self._next], start)


class _NpyMember:
    """One ``.npy`` member of a zip, read front to back in rows without loading it whole."""

    def __init__(self, archive: zipfile.ZipFile, name: str) -> None:
        self.name = name[:-4]
        self._fh = archive.open(name)
        try:
            version = np.lib.format.read_magic(self._fh)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(self._fh)
            elif version == (2, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(self._fh)
            else:
                raise DatasetError(f"array {self.name} uses .npy format {version}; save the file with numpy.savez")
        except DatasetError:
            raise
        except Exception as exc:  # numpy raises ValueError and friends for a corrupt header
            raise DatasetError(f"array {self.name} in the npz file has no valid .npy header: {exc}") from None
        if fortran and len(shape) > 1:
            raise DatasetError(
                f"array {self.name} is stored in Fortran order; save numpy.ascontiguousarray({self.name}) instead"
            )
        self.shape: tuple[int, ...] = tuple(shape)
        self.dtype: np.dtype = dtype
        self.row_items = math.prod(shape[1:]) if shape else 1
        self._read = 0

    def read(self, count: int) -> np.ndarray:
        want = count * self.row_items * self.dtype.itemsize
        data = self._fh.read(want)
        if len(data) != want:
            raise DatasetError(
                f"array {self.name} is truncated: its header promises {self.shape[0]} rows but the data ends "
                f"after row {self._read + len(data) // max(1, self.row_items * self.dtype.itemsize)}"
            )
        self._read += count
        return np.frombuffer(data, dtype=self.dtype).reshape((count, *self.shape[1:]))


class NpzRows:
    """Rows of ``x`` and ``y`` streamed out of an ``.npz`` (zip) file, stored or deflated alike.

    Needs a seekable file; both members are read side by side, one shard's rows at a time.
    """

    def __init__(self, fh: BinaryIO, max_bytes: int) -> None:
        try:
            archive = zipfile.ZipFile(fh)
            names = set(archive.namelist())
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
            raise DatasetError(f"not a readable .npz file: {exc}; save it with numpy.savez") from None
        arrays = sorted(n[:-4] for n in names if n.endswith(".npy"))
        missing = {"x", "y"} - set(arrays)
        if missing:
            raise DatasetError(f"npz file lacks array(s) {', '.join(sorted(missing))}; it has {arrays}")
        try:
            self._x, self._y = _NpyMember(archive, "x.npy"), _NpyMember(archive, "y.npy")
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            raise DatasetError(f"not a readable .npz file: {exc}") from None
        _check_arrays(self._x.shape, self._x.dtype, self._y.shape, self._y.dtype)
        self.rows = self._x.shape[0]
        self.row_bytes = _stored_row_bytes(self._x.shape, self._x.dtype, self._y.dtype)
        raw = self.rows * (self._x.row_items * self._x.dtype.itemsize + self._y.dtype.itemsize)
        if raw > max_bytes:
            # A small deflated file can unpack to far more than was uploaded.
            raise DatasetError(
                f"arrays x and y hold {raw} bytes uncompressed, over the limit of {max_bytes} bytes; "
                "upload a smaller dataset"
            )
        self._next = 0

    def read(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        start, self._next = self._next, self._next + count
        try:
            x, y = self._x.read(count), self._y.read(count)
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:  # zlib and CRC errors surface here
            raise DatasetError(f"the npz file is damaged: {exc}") from None
        return _stored_rows(x, y, start)


def tensor_pieces(
    source: RowSource, samples_per_shard: int, num_train: int, num_validation: int, progress: ProgressFn = _no_progress
) -> Iterator[ShardPiece]:
    """Safetensors shards of ``samples_per_shard`` rows: ``num_train`` rows, then ``num_validation`` held out."""
    done = 0
    for split, remaining in ((Shard.Split.TRAIN.value, num_train), (Shard.Split.VALIDATION.value, num_validation)):
        while remaining > 0:
            count = min(samples_per_shard, remaining)
            xs, ys = source.read(count)
            yield split, save_safetensors({"x": xs, "y": ys}), count
            remaining -= count
            done += count
            progress(done / max(1, num_train + num_validation))


def _check_finite(source: RowSource, rows_per_read: int, progress: ProgressFn) -> None:
    done = 0
    while done < source.rows:
        count = min(rows_per_read, source.rows - done)
        source.read(count)
        done += count
        progress(done / source.rows)


def create_tensor_dataset(
    name: str,
    x: np.ndarray,
    y: np.ndarray,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    *,
    validation_fraction: float = 0.0,
    owner: User | None = None,
) -> Dataset:
    """A dataset of feature rows ``x`` and labels ``y``.

    Raises:
        DatasetError: for mismatched, empty, non-numeric or non-finite arrays.
    """
    rows = ArrayRows(x, y)
    _stored_rows(x, y, 0)  # every value checked before anything is written
    num_train, num_validation = split_sizes(rows.rows, validation_fraction)
    source = hashlib.sha256(np.ascontiguousarray(x).tobytes() + np.ascontiguousarray(y).tobytes()).hexdigest()
    with transaction.atomic():
        dataset = Dataset.objects.create(
            name=name,
            owner=owner,
            kind=Dataset.Kind.TENSORS,
            source_sha256=source,
            validation_fraction=validation_fraction,
        )
        per_shard = max(1, shard_bytes // rows.row_bytes)
        return fill_dataset(dataset, tensor_pieces(rows, per_shard, num_train, num_validation))


def create_npz_dataset(
    name: str, data: bytes, shard_bytes: int = DEFAULT_SHARD_BYTES, *, validation_fraction: float = 0.0
) -> Dataset:
    """A dataset from an ``.npz`` file with arrays ``x`` and ``y`` (pickles refused).

    Raises:
        DatasetError: if the file is not an npz, or its arrays are missing or wrong.
    """
    with transaction.atomic():
        dataset = Dataset.objects.create(
            name=name,
            kind=Dataset.Kind.TENSORS,
            source_sha256=hashlib.sha256(data).hexdigest(),
            source_format=Dataset.Format.NPZ,
            validation_fraction=validation_fraction,
        )
        return shard_source(dataset, lambda: io.BytesIO(data), len(data), shard_bytes=shard_bytes)


# ---------------------------------------------------------------- JSONL


def jsonl_texts(fh: BinaryIO, field: str) -> Iterator[bytes]:
    """The UTF-8 bytes of each line's ``field``; blank lines are skipped.

    Raises:
        DatasetError: naming the first bad line and what is wrong with it.
    """
    for number, line in enumerate(iter(lambda: fh.readline(MAX_JSONL_LINE_BYTES + 1), b""), start=1):
        if len(line) > MAX_JSONL_LINE_BYTES:
            raise DatasetError(f"line {number} is longer than {MAX_JSONL_LINE_BYTES} bytes; split the record")
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DatasetError(f"line {number} is not valid JSON: {exc}") from None
        except RecursionError:
            raise DatasetError(f"line {number} nests JSON deeper than the parser goes") from None
        if not isinstance(record, dict):
            raise DatasetError(f"line {number} is not a JSON object but {type(record).__name__}")
        if field not in record:
            raise DatasetError(f"line {number} has no {field!r} field; its fields are {sorted(record)[:10]}")
        text = record[field]
        if not isinstance(text, str):
            raise DatasetError(f"line {number}: field {field!r} must be a string, got {type(text).__name__}")
        yield text.encode("utf-8")


def _joined(texts: Iterable[bytes]) -> Iterator[bytes]:
    for index, text in enumerate(texts):
        if index:
            yield JSONL_SEPARATOR
        yield text


# ---------------------------------------------------------------- an uploaded source


def shard_source(
    dataset: Dataset,
    open_source: Callable[[], BinaryIO],
    size: int,
    *,
    shard_bytes: int | None = None,
    progress: ProgressFn = _no_progress,
) -> Dataset:
    """Shard a source file into ``dataset`` after checking it whole; ``open_source`` is called once per pass.

    The dataset names the format (``source_format``), ``sample_len``,
    ``text_field`` and ``validation_fraction``. Two passes: the first checks
    every line or value and counts the samples (so errors come before any
    shard is written, and the split sizes are known), the second writes.

    Raises:
        DatasetError: saying what is wrong with the file.
    """
    shard_bytes = shard_bytes or settings.CROWDTRAIN_SHARD_BYTES
    check, write = (lambda f: progress(f / 2)), (lambda f: progress(0.5 + f / 2))
    if size == 0:
        raise DatasetError("the file is empty")
    fmt = dataset.source_format
    if fmt == Dataset.Format.NPZ:
        with open_source() as fh:
            _check_finite(NpzRows(fh, settings.CROWDTRAIN_MAX_UPLOAD_BYTES), 65536, check)
        with open_source() as fh:
            rows = NpzRows(fh, settings.CROWDTRAIN_MAX_UPLOAD_BYTES)
            num_train, num_validation = split_sizes(rows.rows, dataset.validation_fraction)
            dataset.kind = Dataset.Kind.TENSORS
            dataset.save(update_fields=["kind"])
            per_shard = max(1, shard_bytes // rows.row_bytes)
            return fill_dataset(dataset, tensor_pieces(rows, per_shard, num_train, num_validation, write))
    if fmt == Dataset.Format.IMAGES:
        from .images import shard_images

        return shard_images(dataset, open_source, size, shard_bytes=shard_bytes, progress=progress)
    if fmt not in (Dataset.Format.TEXT, Dataset.Format.JSONL):
        raise DatasetError(f"unknown format {fmt!r}; expected one of {', '.join(Dataset.Format.values)}")
    sample_len = dataset.sample_len
    if sample_len < 2:
        raise DatasetError(f"sample_len must be at least 2 bytes, got {sample_len}")
    if dataset.kind == Dataset.Kind.TOKENS:
        return _shard_tokens(dataset, open_source, size, shard_bytes, progress)
    if fmt == Dataset.Format.TEXT:
        with open_source() as fh:
            total = _check_text(fh, size, check)
        describe = f"text of {total} bytes"
    else:
        with open_source() as fh:
            total, texts = 0, 0
            for piece in _joined(jsonl_texts(fh, dataset.text_field)):
                total += len(piece)
                texts += 1
                check(min(1.0, fh.tell() / size))
        if texts == 0:
            raise DatasetError(f"the file holds no JSON line with a {dataset.text_field!r} field")
        describe = f"the joined texts ({total} bytes)"
    if total < sample_len:
        raise DatasetError(f"{describe} is shorter than one sample of {sample_len} bytes")
    num_train, num_validation = split_sizes(total // sample_len, dataset.validation_fraction)
    dataset.kind = Dataset.Kind.TEXT
    dataset.save(update_fields=["kind"])
    per_shard = max(1, shard_bytes // sample_len)
    with open_source() as fh:
        if fmt == Dataset.Format.TEXT:
            blocks: Iterable[bytes] = read_blocks(fh)
        else:
            blocks = _joined(jsonl_texts(fh, dataset.text_field))
        pieces = text_pieces(blocks, sample_len, per_shard, num_train, num_validation)
        return fill_dataset(dataset, counted(pieces, num_train + num_validation, write))


def counted(pieces: Iterable[ShardPiece], total_samples: int, progress: ProgressFn) -> Iterator[ShardPiece]:
    """The pieces, telling ``progress`` the fraction of ``total_samples`` written after each."""
    done = 0
    for piece in pieces:
        done += piece[2]
        progress(done / max(1, total_samples))
        yield piece


def from_any_thread(progress: ProgressFn) -> ProgressFn:
    """``progress`` for a library that calls back from threads of its own: there, each call closes the
    thread's database connection after it (nothing else would), and a failed write never stops the work.
    """
    owner = threading.get_ident()

    def call(fraction: float) -> None:
        if threading.get_ident() == owner:
            progress(fraction)
            return
        try:
            progress(fraction)
        except DatabaseError as exc:
            logger.debug("progress not written: %s", exc)
        finally:
            connection.close()

    return call


def set_stage(dataset: Dataset, stage: str) -> None:
    """What the dataset's page says sharding is doing (a tokenized upload has three long stages)."""
    Dataset.objects.filter(pk=dataset.pk).update(stage=stage)


def _shard_tokens(
    dataset: Dataset, open_source: Callable[[], BinaryIO], size: int, shard_bytes: int, progress: ProgressFn
) -> Dataset:
    """Tokenize a text or JSONL upload and cut its ids into shards of ``sample_len`` ids per sample.

    The tokenizer is the one the dataset names (uploaded before), or a BPE of
    ``vocab_size`` tokens trained on the upload first. Ids go to a temporary
    file, so their count (hence the split) is known before any shard is stored.

    Raises:
        DatasetError: for a file that is not UTF-8 text, a bad JSONL line, or too few tokens.
    """
    from . import tokenizing

    jsonl = dataset.source_format == Dataset.Format.JSONL

    def texts(fh: BinaryIO, report: ProgressFn) -> Iterator[str]:
        if not jsonl:
            yield from tokenizing.text_pieces(read_blocks(fh), report, size)
            return
        for text in jsonl_texts(fh, dataset.text_field):
            report(min(1.0, fh.tell() / size))
            yield text.decode("utf-8")

    try:
        if dataset.tokenizer_sha256:
            with default_storage.open(shard_storage_name(dataset.tokenizer_sha256), "rb") as stored:
                tokenizer = tokenizing.load_tokenizer(stored.read())
            trained = 0.0
        else:
            set_stage(dataset, f"training a tokenizer of {dataset.vocab_size} tokens")
            # The library reads the texts from a thread of its own.
            report = from_any_thread(lambda f: progress(0.4 * f))
            with open_source() as fh:
                tokenizer = tokenizing.train_bpe(texts(fh, report), dataset.vocab_size)
            dataset.tokenizer_sha256, _ = tokenizing.store_tokenizer(tokenizer)
            trained = 0.4
    except tokenizing.TokenizerError as exc:
        raise DatasetError(str(exc)) from None
    set_stage(dataset, "tokenizing")
    with open_source() as fh:
        ids, total, width = tokenizing.tokenize_to_file(
            tokenizer, texts(fh, lambda f: progress(trained + (0.9 - trained) * f)), documents=jsonl
        )
    with ids:
        sample_len = dataset.sample_len
        if total < sample_len:
            raise DatasetError(f"the text is {total} tokens long, shorter than one sample of {sample_len} tokens")
        num_train, num_validation = split_sizes(total // sample_len, dataset.validation_fraction)
        dataset.vocab_size = tokenizing.vocab_size(tokenizer)
        dataset.token_bytes = width
        dataset.save(update_fields=["tokenizer_sha256", "vocab_size", "token_bytes"])
        set_stage(dataset, f"writing shards of {total:,} tokens")
        per_shard = max(1, shard_bytes // (sample_len * width))
        pieces = text_pieces(read_blocks(ids), sample_len * width, per_shard, num_train, num_validation)
        filled = fill_dataset(dataset, counted(pieces, num_train + num_validation, lambda f: progress(0.9 + f / 10)))
    set_stage(dataset, "")
    return filled


def _check_text(fh: BinaryIO, size: int, progress: ProgressFn) -> int:
    """The byte count of a text file, refusing binary files (a NUL byte is never in text)."""
    total = 0
    for block in read_blocks(fh):
        nul = block.find(b"\0")
        if nul >= 0:
            raise DatasetError(
                f"byte {total + nul} is a NUL byte: this looks like a binary file, not plain text; "
                "upload a .txt corpus, or choose the npz format for arrays"
            )
        total += len(block)
        progress(min(1.0, total / size))
    return total


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
