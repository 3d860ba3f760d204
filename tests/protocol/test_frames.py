from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crowdtrain_agent.protocol import ProtocolError, chunk_fragments, decode_chunk, should_reconnect, split_payload
from crowdtrain_agent.protocol.frames import CHUNK_HEADER_BYTES, MAX_WS_MESSAGE_BYTES, CloseCode


@given(payload=st.binary(max_size=5000), chunk=st.integers(1, 700))
def test_chunks_reassemble_to_the_payload(payload: bytes, chunk: int) -> None:
    frames = split_payload(payload, chunk)

    parts = [decode_chunk(frame) for frame in frames]

    assert b"".join(bytes(body) for _, body in parts) == payload
    assert [h.chunk_index for h, _ in parts] == list(range(len(frames)))
    assert {h.num_chunks for h, _ in parts} == {len(frames)}
    assert all(len(frame) <= MAX_WS_MESSAGE_BYTES for frame in frames)


@given(payload=st.binary(max_size=5000), chunk=st.integers(1, 700))
def test_fragment_pairs_make_the_same_messages_without_copying_the_payload(payload: bytes, chunk: int) -> None:
    buffer = bytearray(payload)

    pairs = chunk_fragments(buffer, chunk)

    assert [header + bytes(part) for header, part in pairs] == split_payload(payload, chunk)
    if buffer:  # the parts are views: a change to the gradient's memory shows through them
        buffer[0] ^= 0xFF
        assert pairs[0][1][0] == buffer[0]


@pytest.mark.parametrize(
    ("frame", "problem"),
    [
        (b"CTG", "shorter than"),
        (struct.pack("!4sIII", b"XXXX", 0, 1, 0), "expected b'CTGC'"),
        (struct.pack("!4sIII", b"CTGC", 0, 1, 5) + b"abc", "says 5 payload bytes"),
        (struct.pack("!4sIII", b"CTGC", 3, 2, 0), "outside 0..1"),
        (struct.pack("!4sIII", b"CTGC", 0, 1, 0) + b"x" * MAX_WS_MESSAGE_BYTES, "over the"),
    ],
)
def test_it_rejects_malformed_chunks(frame: bytes, problem: str) -> None:
    with pytest.raises(ProtocolError, match=problem):
        decode_chunk(frame)


def test_the_header_is_sixteen_bytes() -> None:
    assert CHUNK_HEADER_BYTES == 16


def test_agents_give_up_only_on_codes_no_retry_can_fix() -> None:
    assert should_reconnect(None)
    assert should_reconnect(CloseCode.GOING_AWAY)
    assert should_reconnect(1006)
    assert not should_reconnect(CloseCode.UNAUTHORIZED)
    assert not should_reconnect(CloseCode.REVOKED)
    assert not should_reconnect(CloseCode.UNSUPPORTED_VERSION)
