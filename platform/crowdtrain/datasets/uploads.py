"""Resumable chunked dataset uploads: the rules on a new upload, chunks kept in storage, reading them back.

Every chunk is its own storage object (``uploads/<id>/<offset>-<random>``),
so the local media folder and S3 work alike and the site never holds more
than one chunk in memory. The sharding task reads the chunks back in order
through ``open_upload`` as one seekable file. The HTTP API is ``upload_views``.
"""

from __future__ import annotations

import bisect
import errno
import hashlib
import io
import logging
import re
import secrets
import threading
from typing import Any, BinaryIO

import msgspec
from django.conf import settings
from django.core.files.base import ContentFile
from django.core.files.storage import default_storage
from django.db import connection, transaction
from django.urls import reverse

from crowdtrain.lib import jsonbodies
from crowdtrain_agent.models import max_text_sample_len
from crowdtrain_agent.models.registry import BYTE_VOCAB, IMAGE_SIZES, MAX_VOCAB

from .models import Dataset, Pretrained, Upload, UploadChunk, shard_storage_name

logger = logging.getLogger(__name__)


_SHA256 = re.compile(r"^[0-9a-f]{64}$")
MIN_IMAGE_SIZE, MAX_IMAGE_SIZE = IMAGE_SIZES


class UploadError(ValueError):
    """A request the upload API refuses; ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.extra = extra


def describe(upload: Upload) -> dict[str, Any]:
    data: dict[str, Any] = {
        "id": str(upload.pk),
        "name": upload.name,
        "filename": upload.filename,
        "format": upload.format,
        "size": upload.size,
        "received": upload.received,
        "state": upload.state,
        "chunk_bytes": settings.CROWDTRAIN_UPLOAD_CHUNK_BYTES,
        "dataset": upload.dataset_id,
    }
    if upload.dataset_id:
        data["dataset_url"] = data["page_url"] = reverse("dataset-detail", args=[upload.dataset_id])
        data["status_url"] = reverse("dataset-status", args=[upload.dataset_id])
    if upload.pretrained_id:
        data["page_url"] = reverse("pretrained-detail", args=[upload.pretrained_id])
        data["status_url"] = reverse("pretrained-status", args=[upload.pretrained_id])
    return data


# ---------------------------------------------------------------- creating an upload


class UploadRequest(msgspec.Struct):
    """The page's JSON that opens an upload; a null optional field takes its default, as if left out.

    The value rules (sizes, lengths after trimming, a known tokenizer) follow in ``create_upload``, whose
    messages say what to do; the types are checked here, all at once.
    """

    filename: str
    size: int
    format: str
    sha256: str | None = None  # of the whole file, checked when the last chunk is in
    name: str | None = None  # the dataset's; the file name without its extension when left out
    sample_len: int | None = None  # text and jsonl only
    text_field: str | None = None  # jsonl only: the key that holds each line's text
    tokenizer: str | None = None  # "" (bytes), "train", or the sha256 of a tokenizer.json uploaded before
    vocab_size: int | None = None  # with tokenizer "train"
    image_size: int | None = None  # images only


def create_upload(owner: Any, body: dict[str, Any]) -> Upload:
    """A new upload from the page's JSON; checks everything that can be checked before any byte arrives.

    Raises:
        UploadError: naming the field that is wrong.
    """
    try:
        request = jsonbodies.convert(body, UploadRequest)
    except jsonbodies.BodyError as exc:
        raise UploadError(str(exc)) from None
    filename = request.filename.strip()
    if not filename or len(filename) > 255:
        raise UploadError("filename must hold 1 to 255 characters")
    size = request.size
    if size <= 0:
        raise UploadError("the file is empty; choose a file with data in it")
    cap = settings.CROWDTRAIN_MAX_UPLOAD_BYTES
    if size > cap:
        raise UploadError(f"the file is {size} bytes, over the limit of {cap} bytes", status=413, limit=cap)
    fmt = request.format
    formats = [value for value, _ in Upload.FORMATS]
    if fmt not in formats:
        raise UploadError(f"unknown format {fmt!r}; expected one of {', '.join(formats)}")
    sha256 = (request.sha256 or "").strip().lower()
    if sha256 and not _SHA256.match(sha256):
        raise UploadError(f"sha256 must be 64 hexadecimal digits, got {sha256!r}")
    name = (request.name or "").strip() or filename.rsplit(".", 1)[0] or filename
    if len(name) > 200:
        raise UploadError("name must be at most 200 characters")
    sample_len, text_field, tokenizer, vocab_size, image_size = 0, "text", "", 0, 0
    if fmt in (Dataset.Format.TEXT, Dataset.Format.JSONL):
        tokenizer, vocab_size = _tokenizer_fields(request)
        if request.sample_len is None:
            raise UploadError("sample_len is required")
        sample_len = request.sample_len
        longest = max_text_sample_len()
        unit = "token ids" if tokenizer else "bytes"
        if not 2 <= sample_len <= longest:
            raise UploadError(
                f"sample_len must be between 2 and {longest} {unit}, the longest sample a text model here trains "
                f"on (block_size + 1), got {sample_len}"
            )
    if fmt == Dataset.Format.JSONL:
        text_field = (request.text_field or "text").strip()
        if not text_field or len(text_field) > 100:
            raise UploadError("text_field must hold 1 to 100 characters")
    if fmt == Dataset.Format.IMAGES:
        image_size = request.image_size if request.image_size is not None else settings.CROWDTRAIN_IMAGE_SIZE
        if not MIN_IMAGE_SIZE <= image_size <= MAX_IMAGE_SIZE:
            raise UploadError(
                f"image_size must be between {MIN_IMAGE_SIZE} and {MAX_IMAGE_SIZE} pixels, got {image_size}"
            )
    return Upload.objects.create(
        owner=owner,
        name=name,
        filename=filename,
        size=size,
        sha256=sha256,
        format=fmt,
        sample_len=sample_len,
        text_field=text_field,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        image_size=image_size,
    )


def _tokenizer_fields(request: UploadRequest) -> tuple[str, int]:
    """``tokenizer`` ("" for bytes, "train", or the sha256 of a tokenizer uploaded before) and the vocabulary to train.

    Raises:
        UploadError: naming the field.
    """
    tokenizer = (request.tokenizer or "").strip().lower()
    if not tokenizer:
        return "", 0
    if tokenizer == "train":
        vocab = request.vocab_size if request.vocab_size is not None else settings.CROWDTRAIN_TOKENIZER_VOCAB
        if not BYTE_VOCAB < vocab <= MAX_VOCAB:
            raise UploadError(
                f"vocab_size must be between {BYTE_VOCAB + 1} (the 256 bytes and an end-of-text token) and "
                f"{MAX_VOCAB}, got {vocab}"
            )
        return "train", vocab
    if not _SHA256.match(tokenizer):
        raise UploadError(
            'tokenizer must be empty (bytes), "train", or the sha256 the tokenizer upload answered, '
            f"got {tokenizer[:80]!r}"
        )
    if not default_storage.exists(shard_storage_name(tokenizer)):
        raise UploadError(f"no tokenizer {tokenizer[:12]}… was uploaded; upload the tokenizer.json first")
    # Shards live beside tokenizers, under the same kind of name: only a stored tokenizer may be named, or a
    # dataset could claim another campaign's private shard as its "tokenizer" and open it to every device.
    from .tokenizing import TokenizerError, load_tokenizer

    with default_storage.open(shard_storage_name(tokenizer), "rb") as stored:
        data = stored.read(settings.CROWDTRAIN_MAX_TOKENIZER_BYTES + 1)
    try:
        if len(data) > settings.CROWDTRAIN_MAX_TOKENIZER_BYTES:
            raise TokenizerError("too large")
        load_tokenizer(data)
    except TokenizerError:
        raise UploadError(
            f"{tokenizer[:12]}… is not a tokenizer uploaded here; upload the tokenizer.json first"
        ) from None
    return tokenizer, 0


# ---------------------------------------------------------------- tokenizers


def store_uploaded_tokenizer(data: bytes) -> dict[str, Any]:
    """Check an organizer's tokenizer.json and store it under its sha256, as shards are stored.

    Raises:
        UploadError: for a file that is too big or not a tokenizer the platform can use.
    """
    from .sharding import store_object
    from .tokenizing import TokenizerError, load_tokenizer, vocab_size

    cap = settings.CROWDTRAIN_MAX_TOKENIZER_BYTES
    if not data:
        raise UploadError("the tokenizer file is empty; upload a tokenizer.json")
    if len(data) > cap:
        raise UploadError(f"a tokenizer file may hold at most {cap} bytes", status=413, limit=cap)
    try:
        tokenizer = load_tokenizer(data)
    except TokenizerError as exc:
        raise UploadError(str(exc)) from None
    return {"sha256": store_object(data), "vocab_size": vocab_size(tokenizer), "size": len(data)}


# ---------------------------------------------------------------- chunks


def append_chunk(upload: Upload, offset: int, data: bytes) -> Upload:
    """Store bytes ``offset .. offset+len(data)-1`` if ``offset`` is the resume point.

    The chunk object is written first and the row second, under a check that
    nobody moved the resume point meanwhile; a loser deletes its object.

    Raises:
        UploadError: 409 for a wrong offset (with ``expected_offset``), 413 past the declared size.
    """
    if upload.state != Upload.State.RECEIVING:
        raise UploadError("the upload is already complete", status=409, expected_offset=upload.received)
    if offset != upload.received:
        raise UploadError(
            f"offset {offset} is not the resume point {upload.received}", status=409, expected_offset=upload.received
        )
    if not data:
        raise UploadError("the chunk is empty")
    if offset + len(data) > upload.size:
        raise UploadError(
            f"the chunk ends at byte {offset + len(data)}, past the declared size of {upload.size} bytes", status=413
        )
    name = default_storage.save(f"{upload.storage_prefix}/{offset:015d}-{secrets.token_hex(4)}", ContentFile(data))
    with transaction.atomic():
        moved = Upload.objects.filter(pk=upload.pk, received=offset, state=Upload.State.RECEIVING).update(
            received=offset + len(data)
        )
        if moved:
            UploadChunk.objects.create(upload=upload, offset=offset, size=len(data), name=name)
    upload.refresh_from_db()
    if not moved:
        default_storage.delete(name)
        raise UploadError(
            f"offset {offset} is not the resume point {upload.received}", status=409, expected_offset=upload.received
        )
    return upload


# ---------------------------------------------------------------- completing


def complete_upload(upload: Upload) -> Upload:
    """Check every byte arrived, create the pending Dataset (or Pretrained weights) and queue its task; idempotent.

    Raises:
        UploadError: 409 if bytes are missing.
    """
    from .tasks import convert_pretrained_upload, shard_upload  # tasks imports this module

    with transaction.atomic():
        upload = Upload.objects.select_for_update().get(pk=upload.pk)
        if upload.state == Upload.State.COMPLETE:
            return upload
        if upload.received != upload.size:
            raise UploadError(
                f"received {upload.received} of {upload.size} bytes; send the rest first",
                status=409,
                expected_offset=upload.received,
            )
        if upload.format == Upload.PRETRAINED:
            upload.pretrained = Pretrained.objects.create(name=upload.name, owner=upload.owner)
            upload.state = Upload.State.COMPLETE
            upload.save(update_fields=["pretrained", "state"])
            task = convert_pretrained_upload
        else:
            _create_dataset(upload)
            task = shard_upload
    # After the commit: a worker must find the rows.
    if settings.CELERY_TASK_ALWAYS_EAGER and settings.CROWDTRAIN_EAGER_TASKS_IN_BACKGROUND:
        # The embedded default has no worker: work in a thread, so the request returns at once and
        # the dataset page shows the progress, as it does with a worker.
        threading.Thread(
            target=_run_in_thread, args=(task, str(upload.pk)), name=f"upload-{upload.pk}", daemon=True
        ).start()
    else:
        task.delay(str(upload.pk))
    upload.refresh_from_db()
    return upload


def _create_dataset(upload: Upload) -> None:
    """The pending dataset an upload becomes, with the recipe the sharding task follows."""
    text = upload.format in (Dataset.Format.TEXT, Dataset.Format.JSONL)
    kind = Dataset.Kind.TENSORS
    if text:
        kind = Dataset.Kind.TOKENS if upload.tokenizer else Dataset.Kind.TEXT
    upload.dataset = Dataset.objects.create(
        name=upload.name,
        owner=upload.owner,
        kind=kind,
        source_format=upload.format,
        sample_len=upload.sample_len if text else 0,
        text_field=upload.text_field if upload.format == Dataset.Format.JSONL else "",
        # A tokenizer trained on the upload is named once it exists; its size is asked for now.
        tokenizer_sha256=upload.tokenizer if upload.tokenizer != "train" else "",
        vocab_size=upload.vocab_size,
        image_size=upload.image_size,
        validation_fraction=settings.CROWDTRAIN_VALIDATION_FRACTION,
        status=Dataset.Status.PENDING,
        progress=0.0,
    )
    upload.state = Upload.State.COMPLETE
    upload.save(update_fields=["dataset", "state"])


def _run_in_thread(task: Any, upload_id: str) -> None:
    try:
        task(upload_id)
    except Exception:  # the task marks its dataset or weights failed itself; this is what escaped it
        logger.exception("processing upload %s failed", upload_id)
    finally:
        connection.close()  # this thread's connection would otherwise stay open until exit


# ---------------------------------------------------------------- reading an upload back


class UploadReader(io.RawIOBase):
    """An upload's chunks as one seekable, read-only file (zipfile needs to seek for .npz)."""

    def __init__(self, chunks: list[tuple[int, int, str]], size: int) -> None:
        super().__init__()
        self._offsets = [c[0] for c in chunks]
        self._chunks = chunks
        self._size = size
        self._pos = 0
        self._open: tuple[int, Any] | None = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        if base + pos < 0:
            # As a file does: zipfile probes a short file's end this way and expects OSError.
            raise OSError(errno.EINVAL, f"negative seek position {base + pos}")
        self._pos = base + pos
        return self._pos

    def readinto(self, buffer: Any) -> int:
        if self._pos >= self._size or not len(buffer):
            return 0
        index = bisect.bisect_right(self._offsets, self._pos) - 1
        offset, size, name = self._chunks[index]
        if self._open is None or self._open[0] != index:
            self._close_chunk()
            self._open = (index, default_storage.open(name, "rb"))
        fh = self._open[1]
        fh.seek(self._pos - offset)
        data = fh.read(min(len(buffer), offset + size - self._pos))
        if not data:
            raise OSError(f"upload chunk {name} is shorter than its recorded {size} bytes")
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def _close_chunk(self) -> None:
        if self._open is not None:
            self._open[1].close()
            self._open = None

    def close(self) -> None:
        self._close_chunk()
        super().close()


def open_upload(upload: Upload) -> BinaryIO:
    """The received bytes as one buffered, seekable file.

    Raises:
        OSError: if the stored chunks do not join up (a row without its object).
    """
    chunks = list(upload.chunks.order_by("offset").values_list("offset", "size", "name"))
    expected = 0
    for offset, size, name in chunks:
        if offset != expected:
            raise OSError(f"upload {upload.pk}: chunk {name} starts at {offset}, expected {expected}")
        expected += size
    if expected != upload.received:
        raise OSError(f"upload {upload.pk}: chunks hold {expected} bytes, but {upload.received} were received")
    return io.BufferedReader(UploadReader(chunks, expected), buffer_size=1 << 20)


def upload_sha256(upload: Upload, progress: Any = None) -> str:
    digest = hashlib.sha256()
    done = 0
    with open_upload(upload) as fh:
        while block := fh.read(1 << 20):
            digest.update(block)
            done += len(block)
            if progress is not None:
                progress(done / max(1, upload.size))
    return digest.hexdigest()


def discard_chunks(upload: Upload) -> None:
    """Delete the received bytes; the Upload row stays as a record of where the dataset came from."""
    for name in upload.chunks.values_list("name", flat=True):
        default_storage.delete(name)
    upload.chunks.all().delete()
