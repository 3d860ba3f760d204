from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from crowdtrain_agent.codec import decode_fp16, decode_fp32, encode_fp16, encode_fp32, get_codec
from crowdtrain_agent.protocol import ProtocolError

FINITE = arrays(np.float32, st.integers(0, 300), elements=st.floats(-1e4, 1e4, width=32))


@given(values=FINITE)
def test_fp32_round_trip_is_exact(values: np.ndarray) -> None:
    flat = torch.from_numpy(values)

    decoded = decode_fp32(encode_fp32(flat), flat.numel())

    assert torch.equal(decoded, flat)


@given(values=FINITE)
def test_fp16_round_trip_keeps_three_significant_digits(values: np.ndarray) -> None:
    flat = torch.from_numpy(values)

    decoded = decode_fp16(encode_fp16(flat), flat.numel())

    assert decoded.dtype == torch.float32
    torch.testing.assert_close(decoded, flat, rtol=1e-3, atol=1e-4)


def test_encoded_bytes_are_little_endian() -> None:
    assert encode_fp32(torch.tensor([1.0])) == b"\x00\x00\x80\x3f"


@pytest.mark.parametrize("name", ["fp32", "fp16"])
def test_it_rejects_a_payload_of_the_wrong_length(name: str) -> None:
    codec = get_codec(name)

    with pytest.raises(ProtocolError, match="does not hold 10 elements"):
        codec.decode(codec.encode(torch.zeros(9)), 10)


def test_it_names_the_known_codecs_for_an_unknown_one() -> None:
    with pytest.raises(ProtocolError, match="unknown codec 'int3'; known codecs: fp32, fp16"):
        get_codec("int3")


@pytest.mark.parametrize("name", ["fp32", "fp16"])
@given(values=FINITE, start=st.integers(0, 20))
def test_a_codecs_view_holds_exactly_its_encoded_bytes(name: str, values: np.ndarray, start: int) -> None:
    codec = get_codec(name)
    piece = torch.from_numpy(values)[start:]  # a slice of a larger gradient, as agents send them

    assert bytes(codec.view(piece)) == codec.encode(piece)


@pytest.mark.parametrize("name", ["fp32", "fp16"])
@given(values=FINITE)
def test_adopting_a_buffer_decodes_what_decode_does(name: str, values: np.ndarray) -> None:
    codec = get_codec(name)
    wire = codec.encode(torch.from_numpy(values))

    adopted = codec.adopt(bytearray(wire), values.size)

    assert adopted.dtype == torch.float32
    assert torch.equal(adopted, codec.decode(wire, values.size))


def test_an_adopted_fp32_buffer_is_not_copied() -> None:
    buffer = bytearray(encode_fp32(torch.tensor([1.0, 2.0])))

    adopted = get_codec("fp32").adopt(buffer, 2)
    buffer[0:4] = encode_fp32(torch.tensor([7.0]))

    assert adopted.tolist() == [7.0, 2.0]


@pytest.mark.parametrize("name", ["fp32", "fp16"])
def test_adopt_rejects_a_buffer_of_the_wrong_length(name: str) -> None:
    codec = get_codec(name)

    with pytest.raises(ProtocolError, match="does not hold 10 elements"):
        codec.adopt(bytearray(codec.encode(torch.zeros(9))), 10)
