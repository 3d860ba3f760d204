"""Parameter deltas: bit-exact for any fp32 bit patterns, and strict about the bytes that come from the network."""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
import zstandard
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from crowdtrain_agent import deltas
from crowdtrain_agent.deltas import (
    DeltaError,
    decode_delta,
    decode_delta_into,
    encode_delta,
    max_delta_size,
    write_delta,
)
from crowdtrain_agent.protocol import ProtocolError

# Any 32-bit pattern read as fp32: NaNs with payloads, infinities, subnormals, negative zero.
BITS = st.integers(0, 2**32 - 1)


@st.composite
def pairs(draw: st.DrawFn) -> tuple[bytes, bytes]:
    """(wanted, held): two fp32 buffers of one length, the wanted one often a small step from the held one."""
    held = draw(arrays(np.uint32, st.integers(0, 300), elements=BITS))
    if draw(st.booleans()):
        wanted = draw(arrays(np.uint32, held.size, elements=BITS))
    else:  # like an optimizer step: only the low bits of some elements move
        wanted = held ^ draw(arrays(np.uint32, held.size, elements=st.integers(0, 2**12)))
    return wanted.astype("<u4").tobytes(), held.astype("<u4").tobytes()


@given(pair=pairs())
def test_a_delta_rebuilds_the_wanted_bytes_bit_for_bit(pair: tuple[bytes, bytes]) -> None:
    wanted, held = pair

    body = encode_delta(wanted, held)

    assert decode_delta(body, held) == wanted


@given(pair=pairs())
def test_a_delta_is_decoded_into_the_callers_buffer(pair: tuple[bytes, bytes]) -> None:
    wanted, held = pair
    out = bytearray(b"\xaa" * len(wanted))

    decode_delta_into(encode_delta(wanted, held), held, memoryview(out))

    assert out == wanted


@given(pair=pairs(), piece=st.integers(1, 40))
def test_a_delta_written_in_pieces_reads_every_input_byte_once_per_plane(pair: tuple[bytes, bytes], piece: int) -> None:
    # The aggregator writes bodies this way, letting each piece of both versions' pages go once it reported it.
    wanted, held = pair
    out = io.BytesIO()
    read: list[tuple[int, int]] = []

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(deltas, "STREAM_ELEMENTS", piece)
        write_delta(wanted, held, out, read=lambda start, length: read.append((start, start + length)))
        rebuilt = decode_delta(out.getvalue(), held)  # and decoded in pieces of the body

    assert rebuilt == wanted
    elements = len(held) // 4
    each_plane = [(4 * start, 4 * min(elements, start + piece)) for start in range(0, elements, piece)]
    assert read == each_plane * 4


def test_nan_payloads_and_signed_zeros_survive() -> None:
    held = struct.pack("<4f", 1.0, -0.0, float("inf"), 2.5)
    wanted = struct.pack("<4I", 0x7FC00123, 0x00000000, 0xFF800001, 0x80000001)  # quiet NaN with payload, +0, ...

    assert decode_delta(encode_delta(wanted, held), held) == wanted


def test_consecutive_versions_of_a_slowly_moving_vector_compress() -> None:
    rng = np.random.default_rng(0)
    held = rng.standard_normal(50_000).astype("<f4")
    wanted = (held - 1e-3 * np.sign(held) * np.abs(held) * rng.random(held.size)).astype("<f4")  # AdamW-sized

    body = encode_delta(wanted.tobytes(), held.tobytes())

    assert len(body) < 0.85 * wanted.nbytes  # the sign, exponent and high mantissa bytes mostly vanish


def test_buffers_of_different_lengths_are_a_callers_mistake() -> None:
    with pytest.raises(ValueError, match="different slices"):
        encode_delta(b"\0" * 8, b"\0" * 4)


def _sample() -> tuple[bytes, bytes, bytes]:
    rng = np.random.default_rng(1)
    held = rng.standard_normal(1000).astype("<f4")
    wanted = (held * np.float32(1.001)).astype("<f4")
    return wanted.tobytes(), held.tobytes(), encode_delta(wanted.tobytes(), held.tobytes())


@given(cut=st.integers(0, 10_000), piece=st.sampled_from([5, 64, deltas.STREAM_ELEMENTS]))
def test_a_truncated_body_is_refused(cut: int, piece: int) -> None:
    wanted, held, body = _sample()

    with pytest.MonkeyPatch.context() as patch, pytest.raises(DeltaError):
        patch.setattr(deltas, "STREAM_ELEMENTS", piece)  # bytes of the body decompressed at a time
        decode_delta(body[: cut % len(body)], held)


@pytest.mark.parametrize("piece", [5, 64, deltas.STREAM_ELEMENTS])
def test_trailing_bytes_are_refused_whatever_piece_they_arrive_in(piece: int, monkeypatch: pytest.MonkeyPatch) -> None:
    wanted, held, body = _sample()
    monkeypatch.setattr(deltas, "STREAM_ELEMENTS", piece)

    with pytest.raises(DeltaError, match="has data after its zstd frame"):
        decode_delta(body + b"\0" * 70, held)


@given(position=st.integers(0, 10_000), flip=st.integers(1, 255))
def test_a_corrupted_body_is_refused_or_yields_other_bytes_never_an_unchecked_crash(position: int, flip: int) -> None:
    # A flipped byte in the compressed data may still decode (zstd carries no checksum here): what
    # catches it then is the sha256 of the result (``fetch``), which differs, unless the flip hit a
    # header bit zstd ignores and the bytes come out right. Either way, no other exception.
    wanted, held, body = _sample()
    damaged = bytearray(body)
    damaged[position % len(body)] ^= flip

    try:
        rebuilt = decode_delta(bytes(damaged), held)
    except DeltaError:
        return
    assert isinstance(rebuilt, bytes)


def test_trailing_bytes_after_the_frame_are_refused() -> None:
    wanted, held, body = _sample()

    with pytest.raises(DeltaError, match="has data after its zstd frame"):
        decode_delta(body + b"\0\0\0\0", held)


def test_a_delta_of_another_size_is_refused_with_both_sizes() -> None:
    wanted, held, body = _sample()

    with pytest.raises(DeltaError, match=f"decompresses to {len(held)} bytes, the slice has {len(held) - 4}"):
        decode_delta(body, held[:-4])


def test_a_frame_that_would_expand_beyond_the_slice_is_refused_before_decompressing() -> None:
    held = b"\0" * (64 << 10)
    bomb = zstandard.ZstdCompressor(level=19).compress(b"\0" * (64 << 20))  # 64 MB from 2 kB

    with pytest.raises(DeltaError, match=f"decompresses to {64 << 20} bytes, the slice has {64 << 10}"):
        decode_delta(bomb, held)


def test_a_frame_without_its_content_size_is_refused() -> None:
    held = b"\0" * 64
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * 64)

    with pytest.raises(DeltaError, match="an unannounced number of bytes"):
        decode_delta(unsized, held)


def test_a_body_larger_than_any_delta_of_the_slice_is_refused_unread() -> None:
    held = b"\0" * 400

    with pytest.raises(DeltaError, match="larger than any delta"):
        decode_delta(b"\0" * (max_delta_size(400) + 1), held)


def test_what_is_not_zstd_is_refused_as_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="no valid zstd frame header"):
        decode_delta(b"not a zstd frame at all", b"\0" * 16)
