"""Pending gradients held in files and mapped in to be read: an aggregator's memory does not grow with its uploads.

A pending upload is an fp32 copy of one slice of one lease's gradient, kept
until a commit names it. At 100M parameters each is 200 MB per slice, and the
pending uploads of a step and the next one were most of an aggregator's
resident memory. Here a large upload's bytes go to a file in the spool folder
as its chunks arrive, and the tensor the rules read is a private mapping of
that file: what the process holds is the kernel's page cache, which it can
write out and give back under pressure, and never more of it at a time than
a pass is reading (``release_pages`` after each pass).

The files have no name (``tempfile.TemporaryFile``, ``O_TMPFILE`` on Linux):
the kernel frees a file's blocks when its last mapping goes, so neither a
commit that forgets an upload nor a crash leaves anything to clean up.

Small uploads stay in memory (``min_bytes``): a toy model's 4 MB gradient
costs more in system calls than it saves.
"""

from __future__ import annotations

import logging
import mmap
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

import numpy as np
import torch

__all__ = ["DEFAULT_MIN_BYTES", "Body", "Spool", "SpoolFile", "release_pages"]

# Bytes an aggregator keeps and serves (a snapshot, a delta body): in memory, or a mapping of a spool file.
Body = bytes | memoryview | mmap.mmap

logger = logging.getLogger(__name__)

# Uploads below this many bytes stay in memory.
DEFAULT_MIN_BYTES = 4 << 20


def release_pages(pages: object, start: int = 0, length: int | None = None) -> None:
    """Drop a spooled mapping's pages from the resident set; the next read takes them from the file again.

    ``start`` and ``length`` (bytes; None: to the end) let a pass give back
    what it read piece by piece; the range widens to whole pages, and a
    partial page at either end stays. Nothing for anything else (bytes, a
    tensor in memory, None): advice to drop anonymous memory would zero it.
    """
    if not isinstance(pages, mmap.mmap) or pages.closed:
        return
    if start == 0 and length is None:
        pages.madvise(mmap.MADV_DONTNEED)
        return
    end = len(pages) if length is None else min(len(pages), start + length)
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE  # pages wholly inside the range only: a
    last = end if end == len(pages) else end // mmap.PAGESIZE * mmap.PAGESIZE  # neighbour may be mid-read
    if first < last:
        pages.madvise(mmap.MADV_DONTNEED, first, last - first)


class SpoolFile:
    """One upload's bytes on their way into the spool; ``map`` once they are all written."""

    def __init__(self, file: IO[bytes], nbytes: int) -> None:
        self.file = file
        self.nbytes = nbytes

    def write(self, offset: int, payload: bytes | bytearray | memoryview) -> None:
        """Write one chunk where it belongs (the page cache takes it; the process keeps none of it)."""
        view = memoryview(payload).cast("B")
        while view:  # a regular file takes it all at once, but pwrite may legally write less
            written = os.pwrite(self.file.fileno(), view, offset)
            view, offset = view[written:], offset + written

    def map(self) -> mmap.mmap:
        """The file's bytes as a private mapping (``release_pages``, ``torch.frombuffer``); the file is closed.

        Private (copy-on-write) because torch wants a writable buffer; nothing
        writes to what the spool holds, so no page is ever copied.
        """
        try:
            return mmap.mmap(self.file.fileno(), self.nbytes, access=mmap.ACCESS_COPY)
        finally:
            self.close()

    def map_fp32(self) -> tuple[torch.Tensor, mmap.mmap]:
        """``map``, read as fp32 values: the tensor, and the mapping under it."""
        pages = self.map()
        return torch.frombuffer(pages, dtype=torch.float32), pages

    def close(self) -> None:
        """Give the file up; unmapped, its blocks are freed at once."""
        self.file.close()


class Spool:
    """The folder pending gradients go to, and the size from which they do.

    Args:
        folder: created if missing; a disk, not a tmpfs (whose files are memory).
        min_bytes: uploads smaller than this stay in memory.
    """

    def __init__(self, folder: Path, min_bytes: int = DEFAULT_MIN_BYTES) -> None:
        self.folder = folder
        self.min_bytes = min_bytes

    def wants(self, nbytes: int) -> bool:
        """Whether ``nbytes`` of fp32 values go to the spool (the wire is little-endian fp32, as are its files)."""
        return nbytes >= self.min_bytes and nbytes > 0 and sys.byteorder == "little"

    def open(self, nbytes: int) -> SpoolFile | None:
        """A new, nameless file of ``nbytes`` to write into; None if the folder takes none.

        A full or unwritable disk slows nothing down: the caller holds the
        bytes in memory, as before there was a spool, and a warning says why.
        """
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            file = tempfile.TemporaryFile(dir=self.folder, prefix="spooled-")
        except OSError as exc:
            self._refused(exc)
            return None
        spooled = SpoolFile(file, nbytes)
        try:
            os.ftruncate(file.fileno(), nbytes)
        except OSError as exc:
            spooled.close()
            self._refused(exc)
            return None
        return spooled

    def hold(self, data: bytes | memoryview) -> Body:
        """``data`` as a private mapping of a spool file if it is large enough; as it was otherwise.

        For what an aggregator keeps a while and many read, none change:
        pending gradients decoded from fp16 or int8, parameter snapshots,
        delta bodies.
        """
        if not self.wants(len(data)):
            return data
        file = self.open(len(data))
        if file is None:
            return data
        try:
            file.write(0, data)
        except OSError as exc:  # the disk filled up between the truncate and the write
            file.close()
            self._refused(exc)
            return data
        return file.map()

    def write_with(self, produce: Callable[[IO[bytes]], None]) -> mmap.mmap | None:
        """What ``produce`` writes into a new spool file, mapped; None if the folder takes none.

        For a body whose size is known only once it is written (a delta): the
        bytes go from the producer to the file, never whole through memory.
        On None the caller makes the bytes in memory instead.
        """
        file = self.open(0)
        if file is None:
            return None
        try:
            produce(file.file)
            file.file.flush()
            file.nbytes = file.file.tell()
        except OSError as exc:  # the disk filled up while writing
            file.close()
            self._refused(exc)
            return None
        if file.nbytes == 0:  # nothing to map; an empty body has no pages to spare anyway
            file.close()
            return None
        return file.map()

    def hold_fp32(self, values: torch.Tensor) -> Body:
        """``hold`` of an fp32 tensor's bytes, written from the tensor itself; not spooled, a view of the tensor."""
        return self.hold(values.detach().to(torch.float32).contiguous().numpy().view(np.uint8).data)

    def keep(self, grad: torch.Tensor) -> tuple[torch.Tensor, mmap.mmap | None]:
        """``grad`` (fp32, in memory) moved to the spool if it is large enough, with its mapping; else as it was."""
        if grad.dtype != torch.float32:
            return grad, None
        pages = self.hold_fp32(grad)
        if not isinstance(pages, mmap.mmap):
            return grad, None
        return torch.frombuffer(pages, dtype=torch.float32), pages

    def _refused(self, exc: OSError) -> None:
        logger.warning("cannot write to the spool folder %s (%s); holding the bytes in memory", self.folder, exc)
