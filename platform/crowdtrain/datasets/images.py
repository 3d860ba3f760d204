"""Image uploads: a .zip or .tar of class folders, or a WebDataset .tar, as shards of resized uint8 pixels.

Each image is decoded with Pillow, converted to RGB, cropped to a centred
square and resized to ``image_size`` pixels a side, and stored as a row of a
tensors shard (``x``: uint8, channels x height x width; ``y``: the class id).
Labels come from the folder an image sits in (classes in name order), or from
a WebDataset sample's ``.cls`` file. A file that is not an image is skipped and
named on the dataset's page; the rest of the upload is kept.

The samples are shuffled once, seeded by the upload's sha256: the scheduler
leases samples in order, and class folders would otherwise give whole steps of
one class. Decoded rows wait in a temporary file, so an archive of any size
needs one pass and little memory.
"""

from __future__ import annotations

import io
import logging
import tarfile
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import PurePosixPath
from typing import IO, BinaryIO

import numpy as np
from django.conf import settings

from .models import Dataset
from .sharding import DatasetError, ProgressFn, fill_dataset, split_sizes, tensor_pieces

logger = logging.getLogger(__name__)

CHANNELS = 3  # every image becomes RGB
LABEL_SUFFIX = "cls"  # WebDataset: <key>.cls holds the sample's class id as text
MAX_IMAGE_FILE_BYTES = 64 << 20  # one image file; a bigger member is skipped, not read
SKIPPED_NAMED = 100  # skipped files named on the dataset's page; the rest are counted
MAX_CLASSES = 1 << 20  # the most labels an image family of the registry has


class NotAnImage(ValueError):
    """A member of the archive that does not decode as an image; the message says why."""


def members(fh: BinaryIO) -> Iterator[tuple[str, int, Callable[[], bytes]]]:
    """(name, size, read) of each regular file of a zip or tar (plain or compressed), in archive order.

    Raises:
        DatasetError: if the file is neither a zip nor a tar.
    """
    if zipfile.is_zipfile(fh):
        fh.seek(0)
        try:
            archive = zipfile.ZipFile(fh)
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            raise DatasetError(f"the zip archive is damaged ({exc}); upload it again") from None
        for entry in archive.infolist():
            if not entry.is_dir():
                yield entry.filename, entry.file_size, lambda entry=entry: archive.read(entry)  # type: ignore[misc]
        return
    fh.seek(0)
    try:
        tar = tarfile.open(fileobj=fh, mode="r:*")
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise DatasetError(
            f"not a .zip or .tar archive ({exc}); pack the class folders with zip or tar, or upload a WebDataset .tar"
        ) from None
    try:
        for info in tar:
            tar.members = []  # type: ignore[attr-defined]  # headers read so far: millions must not pile up
            if info.isfile():
                yield info.name, info.size, lambda info=info: tar.extractfile(info).read()  # type: ignore[misc, union-attr]
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        raise DatasetError(f"the archive is damaged ({exc}); upload it again") from None


# A member that cannot be read out of its archive: bad CRC, encrypted, an unsupported compression, truncated.
UNREADABLE = (zipfile.BadZipFile, tarfile.TarError, RuntimeError, NotImplementedError, OSError, EOFError, zlib.error)


def decode(data: bytes, side: int, max_pixels: int) -> np.ndarray:
    """An image file's pixels as RGB, centre-cropped to a square and resized: uint8, (3, side, side).

    Raises:
        NotAnImage: saying why the bytes are not a usable image.
    """
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        image: Image.Image = Image.open(io.BytesIO(data))
        if image.width * image.height > max_pixels:
            raise NotAnImage(
                f"{image.width} x {image.height} pixels, over the limit of {max_pixels} (CROWDTRAIN_MAX_IMAGE_PIXELS)"
            )
        image.draft("RGB", (side, side))  # JPEG decodes at a reduced scale: far faster for big photos
        image = ImageOps.fit(image.convert("RGB"), (side, side), Image.Resampling.BICUBIC)
        pixels = np.asarray(image, dtype=np.uint8)
    except NotAnImage:
        raise
    except UnidentifiedImageError:
        raise NotAnImage(
            "not an image (none of JPEG, PNG, GIF, BMP, WebP, TIFF or the other formats Pillow reads)"
        ) from None
    except Exception as exc:  # a damaged image: Pillow raises OSError, SyntaxError, ValueError...
        raise NotAnImage(f"a damaged image: {str(exc)[:200]}") from None
    return np.ascontiguousarray(pixels.transpose(2, 0, 1))


def _ignored(name: str) -> bool:
    """Files an archiver adds that are not content (macOS resource forks, hidden files)."""
    parts = PurePosixPath(name).parts
    return any(p.startswith(".") or p == "__MACOSX" for p in parts)


def _web_key(name: str) -> tuple[str, str]:
    """WebDataset's (key, extension): the basename splits at its first dot."""
    path = PurePosixPath(name)
    stem, _, ext = path.name.partition(".")
    return str(path.parent / stem), ext.lower()


class _Rows:
    """Decoded images, each a fixed-size row of a temporary file, and what each one's label will be."""

    def __init__(self, side: int) -> None:
        self.side = side
        self.row_bytes = CHANNELS * side * side
        self.file: IO[bytes] = tempfile.TemporaryFile(prefix="crowdtrain-images-")
        self.folders: list[str] = []  # the class folder of each row ("" at the archive's root)
        self.keys: list[str] = []  # the WebDataset key of each row
        self.names: list[str] = []

    def add(self, name: str, pixels: np.ndarray) -> None:
        self.file.write(pixels.tobytes())
        path = PurePosixPath(name)
        self.folders.append(path.parent.name)
        self.keys.append(_web_key(name)[0])
        self.names.append(name)

    def __len__(self) -> int:
        return len(self.names)


class _ShuffledRows:
    """The chosen rows (in a seeded order) of a ``_Rows`` file with their class ids: a ``sharding.RowSource``."""

    def __init__(self, rows: _Rows, order: np.ndarray, labels: np.ndarray) -> None:
        rows.file.flush()
        self._pixels = np.memmap(rows.file, dtype=np.uint8, mode="r", shape=(len(rows), CHANNELS, rows.side, rows.side))
        self._order, self._labels = order, labels
        self.rows = len(order)
        self.row_bytes = rows.row_bytes + 8
        self._next = 0

    def read(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        chosen = self._order[self._next : self._next + count]
        self._next += count
        return np.ascontiguousarray(self._pixels[chosen]), self._labels[chosen].astype(np.int64)


def shard_images(
    dataset: Dataset,
    open_source: Callable[[], BinaryIO],
    size: int,
    *,
    shard_bytes: int,
    progress: ProgressFn,
) -> Dataset:
    """Decode every image of an archive into ``dataset``'s shards; skipped files are recorded on the dataset.

    Raises:
        DatasetError: for a file that is no archive, or one without two classes of readable images.
    """
    side = dataset.image_size or settings.CROWDTRAIN_IMAGE_SIZE
    rows = _Rows(side)
    skipped: list[dict[str, str]] = []
    skipped_count = 0
    classes: dict[str, int] = {}  # WebDataset key -> class id from its .cls file

    def skip(name: str, why: str) -> None:
        nonlocal skipped_count
        skipped_count += 1
        if len(skipped) < SKIPPED_NAMED:
            skipped.append({"name": name[:300], "why": why})

    decoded_cap = settings.CROWDTRAIN_MAX_UPLOAD_BYTES  # what the decoded rows may take, like an upload
    with rows.file, open_source() as fh:
        for name, member_size, read in members(fh):
            progress(0.85 * min(1.0, fh.tell() / max(1, size)))
            if _ignored(name):
                continue
            if _web_key(name)[1] == LABEL_SUFFIX:
                if member_size > 64:
                    skip(name, f"a .cls file holds one class id; this one is {member_size} bytes")
                    continue
                try:
                    text = read()[:32].decode("ascii", "replace").strip()
                except UNREADABLE as exc:
                    skip(name, f"cannot be read from the archive: {str(exc)[:200]}")
                    continue
                if not text.isdigit() or int(text) >= MAX_CLASSES:
                    skip(name, f"a .cls file must hold a class id from 0 to {MAX_CLASSES - 1}, not {text[:20]!r}")
                else:
                    classes[_web_key(name)[0]] = int(text)
                continue
            if member_size > MAX_IMAGE_FILE_BYTES:
                skip(name, f"{member_size} bytes, over the {MAX_IMAGE_FILE_BYTES} a single image may have")
                continue
            if (len(rows) + 1) * rows.row_bytes > decoded_cap:
                raise DatasetError(
                    f"the images decode to more than {decoded_cap:,} bytes at {side} x {side} pixels "
                    "(CROWDTRAIN_MAX_UPLOAD_BYTES); choose a smaller image size or upload fewer images"
                )
            try:
                data = read()
            except UNREADABLE as exc:
                skip(name, f"cannot be read from the archive: {str(exc)[:200]}")
                continue
            try:
                rows.add(name, decode(data, side, settings.CROWDTRAIN_MAX_IMAGE_PIXELS))
            except NotAnImage as exc:
                skip(name, str(exc))
        chosen, labels, names = _labels(rows, classes, skip)
        if len(chosen) == 0:
            raise DatasetError(_nothing_readable(skipped_count, skipped))
        if len(set(labels[chosen].tolist())) < 2:
            raise DatasetError(
                f"every readable image is of one class ({names[int(labels[chosen[0]])]}); a classifier needs at least "
                "two: put each class's images in a folder of its own"
            )
        num_train, num_validation = split_sizes(len(chosen), dataset.validation_fraction)
        seed = int(dataset.source_sha256[:16] or "0", 16)
        order = np.asarray(chosen)[np.random.default_rng(seed).permutation(len(chosen))]
        source = _ShuffledRows(rows, order, labels)
        dataset.kind = Dataset.Kind.TENSORS
        dataset.image_size = side
        dataset.labels = names
        dataset.skipped = skipped
        dataset.skipped_count = skipped_count
        dataset.save(update_fields=["kind", "image_size", "labels", "skipped", "skipped_count"])
        per_shard = max(1, shard_bytes // source.row_bytes)
        pieces = tensor_pieces(source, per_shard, num_train, num_validation, lambda f: progress(0.85 + 0.15 * f))
        filled = fill_dataset(dataset, pieces)
    logger.info(
        "dataset %s: %d images of %d classes, %d files skipped", dataset.pk, len(chosen), len(names), skipped_count
    )
    return filled


def _labels(
    rows: _Rows, classes: dict[str, int], skip: Callable[[str, str], None]
) -> tuple[list[int], np.ndarray, list[str]]:
    """(rows that have a class, every row's class id, the class names in id order).

    With any ``.cls`` file the archive is a WebDataset and ids are those
    files' numbers; otherwise each class folder is a class, in name order.
    """
    labels = np.full(len(rows), -1, dtype=np.int64)
    if classes:
        for index, key in enumerate(rows.keys):
            if key in classes:
                labels[index] = classes[key]
            else:
                skip(rows.names[index], f"no {key}.{LABEL_SUFFIX} file gives this WebDataset sample a class")
        names = [str(i) for i in range(max(labels[labels >= 0], default=-1) + 1)]
    else:
        names = sorted({f for f in rows.folders if f})
        ids = {name: i for i, name in enumerate(names)}
        for index, folder in enumerate(rows.folders):
            if folder:
                labels[index] = ids[folder]
            else:
                skip(rows.names[index], "not in a class folder; put each image in a folder named for its class")
    chosen = [i for i in range(len(rows)) if labels[i] >= 0]
    return chosen, labels, names


def _nothing_readable(count: int, skipped: list[dict[str, str]]) -> str:
    if not count:
        return "the archive holds no files; put the images in one folder per class"
    first = "; ".join(f"{s['name']}: {s['why']}" for s in skipped[:3])
    return f"none of the archive's files is a usable image ({count} skipped; first: {first})"
