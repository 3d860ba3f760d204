"""Parameter versions as compressed differences from a version the agent already holds (lossless).

Terms: the *wanted* version is the one an agent downloads, the *held* version
the one it already has, exactly as the aggregator published it. Both are
little-endian fp32 bytes of the same slice (``codec.encode_fp32``).

A *delta body* is made in three steps, each undone by ``decode_delta_into``:

1. XOR the 32-bit patterns of wanted and held. One optimizer step moves a
   weight by a small fraction of itself, so sign, exponent and the top of the
   mantissa rarely change: the high bytes of the XOR are mostly zero.
2. Shuffle the bytes into four planes: byte 0 of every element, then byte 1,
   2 and 3. The near-zero high bytes then sit together, where a compressor
   finds them; interleaved with the noisy low bytes it would not.
3. Compress the planes as one zstd frame (level 1) that names its content
   size. zstd stores incompressible blocks (the low mantissa bytes) as they
   are at memory speed, so it costs a fraction of zlib's CPU for a smaller
   body (figures in ``tests/benchmarks/protocol.py``).

XOR is exact on any bit pattern, NaN payloads included: the reconstruction is
the wanted bytes bit for bit, which the agent checks against the sha256 the
aggregator sends with every parameter download.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import IO

import numpy as np
import zstandard

from .protocol import ProtocolError

__all__ = [
    "CHECKSUM_HEADER",
    "DELTA_FROM_HEADER",
    "ENCODING",
    "ENCODING_HEADER",
    "DeltaError",
    "decode_delta",
    "decode_delta_into",
    "encode_delta",
    "max_delta_size",
    "shuffled_xor",
    "write_delta",
]

# Headers of GET /params/... answers (agent/PROTOCOL.md, "Parameter downloads").
CHECKSUM_HEADER = "X-Crowdtrain-Sha256"  # sha256 hex of the wanted version's exact fp32 bytes, delta or not
DELTA_FROM_HEADER = "X-Crowdtrain-Delta-From"  # only on a delta body: the held version it applies to
ENCODING_HEADER = "X-Crowdtrain-Delta-Encoding"  # only on a delta body: how it was made
# The value of ENCODING_HEADER this module reads and writes; a body in any other encoding is refused.
ENCODING = "xor-shuffle4-zstd"
ZSTD_LEVEL = 1  # measured: level 3 was no smaller on consecutive training versions, and slower
PLANES = 4  # bytes per fp32 element
# A piece of a body made or read as a stream: elements of each input when writing (16 MiB of each),
# bytes of the body when reading (their planes' bytes are rarely more than twice that).
STREAM_ELEMENTS = 1 << 22

Buffer = bytes | bytearray | memoryview


class DeltaError(ProtocolError):
    """A delta body that cannot be decoded into the wanted version: damaged, truncated, or for another size."""


def max_delta_size(num_bytes: int) -> int:
    """The largest delta body a decoder accepts for ``num_bytes`` of fp32: zstd's worst case, rounded up.

    A body larger than this is not a zstd frame of that content, so receivers
    refuse it before reading it (an aggregator sends fp32 instead of a delta
    that would not be smaller anyway).
    """
    return num_bytes + (num_bytes >> 7) + 4096


def encode_delta(wanted: Buffer, held: Buffer) -> bytes:
    """The delta body that turns ``held`` into ``wanted`` (both little-endian fp32 bytes of one slice).

    Args:
        wanted: the fp32 bytes of the version to send.
        held: the fp32 bytes of the version the receiver holds, the same length.

    Returns:
        One zstd frame of the byte-shuffled XOR, its content size written in its header.

    Raises:
        ValueError: if the lengths differ or are not whole fp32 elements.
    """
    out = io.BytesIO()
    write_delta(wanted, held, out)
    return out.getvalue()


def write_delta(
    wanted: Buffer, held: Buffer, out: IO[bytes], *, read: Callable[[int, int], None] | None = None
) -> None:
    """``encode_delta`` written into ``out`` piece by piece: it holds a piece of the planes, never all of them.

    Each plane is one pass over both inputs, XORing only its byte of every
    element. That reads the inputs four times, yet it is faster than
    shuffling the whole slice first (docs/performance.md, "Streamed deltas"),
    and a slice of 100M parameters no longer costs 400 MB of planes and body.

    Args:
        read: called with (byte offset, length) once a piece of both inputs
            was read, so a caller whose inputs are mappings of files can let
            their pages go (``crowdtrain_backbone.spool``).

    Raises:
        ValueError: if the lengths differ or are not whole fp32 elements.
    """
    _check_pair(wanted, held)
    w = np.frombuffer(wanted, dtype=np.uint8).reshape(-1, PLANES)
    h = np.frombuffer(held, dtype=np.uint8).reshape(-1, PLANES)
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)
    with compressor.stream_writer(out, size=len(wanted), closefd=False) as sink:
        for plane in range(PLANES):
            for start in range(0, len(w), STREAM_ELEMENTS):
                end = min(len(w), start + STREAM_ELEMENTS)
                sink.write(np.bitwise_xor(w[start:end, plane], h[start:end, plane]).data)
                if read is not None:
                    read(start * PLANES, (end - start) * PLANES)


def decode_delta_into(body: Buffer, held: Buffer, out: memoryview) -> None:
    """Rebuild the wanted version's fp32 bytes from a delta body and the held bytes, writing them into ``out``.

    Everything in ``body`` comes from the network: its size, its frame header
    and its content are checked, and at most ``len(out)`` bytes are ever
    decompressed (a small body cannot expand into gigabytes).

    Args:
        body: the delta body as received.
        held: the held version's fp32 bytes, ``len(out)`` of them.
        out: where the wanted bytes go; a writable byte buffer of the slice's size.

    Raises:
        DeltaError: if the body is too large, not one zstd frame of exactly
            ``len(out)`` bytes, or damaged.
        ValueError: if ``held`` and ``out`` differ in length (a caller's mistake, not the network's).
    """
    size = len(out)
    if len(held) != size or size % PLANES:
        raise ValueError(f"held version has {len(held)} bytes but the slice has {size}; they must match")
    if len(body) > max_delta_size(size):
        raise DeltaError(
            f"delta body of {len(body)} bytes is larger than any delta of a {size}-byte slice can be "
            f"({max_delta_size(size)}); the aggregator sent something else, download the full version"
        )
    try:
        announced = zstandard.frame_content_size(body)
    except zstandard.ZstdError as exc:
        raise DeltaError(f"delta body of {len(body)} bytes has no valid zstd frame header ({exc})") from None
    if announced != size:
        raise DeltaError(
            f"delta body decompresses to {announced if announced >= 0 else 'an unannounced number of'} bytes, "
            f"the slice has {size}; it is a delta of another slice or version"
        )
    # Piece by piece, each piece XORed into its plane's place in ``out``: the planes are never whole in
    # memory (a slice's size more, at the peak of a download). A damaged body may leave ``out`` half
    # written; the caller then downloads the version whole into it.
    decompressor = zstandard.ZstdDecompressor().decompressobj()
    target = np.frombuffer(out, dtype=np.uint8).reshape(-1, PLANES)
    base = np.frombuffer(held, dtype=np.uint8).reshape(-1, PLANES)
    elements, done, view = size // PLANES, 0, memoryview(body).cast("B")
    for start in range(0, len(view), STREAM_ELEMENTS):
        try:
            piece = decompressor.decompress(view[start : start + STREAM_ELEMENTS])
        except zstandard.ZstdError as exc:
            raise DeltaError(f"delta body of {len(body)} bytes is damaged: {exc}") from None
        if done + len(piece) > size:
            raise DeltaError(f"delta body decompressed to more than the {size} bytes its header announced")
        plain = np.frombuffer(piece, dtype=np.uint8)
        while len(plain):
            plane, at = divmod(done, elements)
            take = min(len(plain), elements - at)
            np.bitwise_xor(plain[:take], base[at : at + take, plane], out=target[at : at + take, plane])
            plain, done = plain[take:], done + take
        if decompressor.eof:
            if decompressor.unused_data or start + STREAM_ELEMENTS < len(view):
                raise DeltaError(f"delta body of {len(body)} bytes has data after its zstd frame")
            break
    if done != size or not decompressor.eof:
        raise DeltaError(f"delta body decompressed to {done} bytes, expected {size}: it is truncated")


def decode_delta(body: Buffer, held: Buffer) -> bytes:
    """``decode_delta_into`` returning new bytes: the pair of ``encode_delta``.

    Raises:
        DeltaError: as ``decode_delta_into``.
    """
    out = bytearray(len(held))
    decode_delta_into(body, held, memoryview(out))
    return bytes(out)


def shuffled_xor(wanted: Buffer, held: Buffer) -> np.ndarray:
    """Steps 1 and 2 of a delta: byte ``k`` of every element's XOR in row ``k`` of a (4, n) uint8 array.

    One pass over both inputs. Public for the benchmark, which compresses the
    same planes with other compressors.

    Raises:
        ValueError: if the lengths differ or are not whole fp32 elements.
    """
    _check_pair(wanted, held)
    planes = np.empty((PLANES, len(wanted) // PLANES), dtype=np.uint8)
    np.bitwise_xor(
        np.frombuffer(wanted, dtype=np.uint8).reshape(-1, PLANES).T,
        np.frombuffer(held, dtype=np.uint8).reshape(-1, PLANES).T,
        out=planes,
    )
    return planes


def _check_pair(wanted: Buffer, held: Buffer) -> None:
    if len(wanted) != len(held) or len(wanted) % PLANES:
        raise ValueError(
            f"a delta needs two fp32 buffers of one length, got {len(wanted)} and {len(held)} bytes; "
            "the versions belong to different slices"
        )
