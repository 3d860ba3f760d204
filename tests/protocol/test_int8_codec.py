"""The int8 codec: blockwise absmax quantization, within half a scale of every value, and strict about its bytes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from crowdtrain_agent.codec import (
    INT8_BLOCK_SIZE,
    decode_int8,
    encode_int8,
    get_codec,
    int8_size,
    quantize_int8,
)
from crowdtrain_agent.protocol import ProtocolError

BLOCKS = st.sampled_from([32, 33, 64, 256, 1000])
# Every kind of float32 a gradient holds: zeros, subnormals, tiny and huge values, mixed in one block.
ANY_FINITE = st.one_of(
    st.floats(width=32, allow_nan=False, allow_infinity=False),
    st.floats(-(2.0**-126), 2.0**-126, width=32),  # subnormals among them
    st.sampled_from([0.0, -0.0, 1e-45, -1e-45, 3.4e38, -3.4e38]),
)
VECTORS = arrays(np.float32, st.integers(0, 700), elements=ANY_FINITE)


def _blocks_absmax(values: np.ndarray, block_size: int) -> np.ndarray:
    """Each element's block's largest magnitude, in float64."""
    padded = np.zeros(-(-values.size // block_size) * block_size)
    padded[: values.size] = np.abs(values.astype(np.float64))
    return np.repeat(padded.reshape(-1, block_size).max(axis=1), block_size)[: values.size]


@given(values=VECTORS, block_size=BLOCKS)
def test_every_value_comes_back_within_half_a_scale_of_its_block(values: np.ndarray, block_size: int) -> None:
    decoded = decode_int8(encode_int8(torch.from_numpy(values), block_size), values.size, block_size)

    error = np.abs(decoded.numpy().astype(np.float64) - values.astype(np.float64))
    # absmax / 127 / 2, up to float32's rounding of the scale and of q * scale (and 2**-149 below the normals)
    bound = _blocks_absmax(values, block_size) / 254 * (1 + 2**-20) + 2**-149
    assert decoded.dtype == torch.float32 and decoded.shape == (values.size,)
    assert (error <= bound).all(), float((error - bound).max())


@given(values=arrays(np.float32, st.integers(0, 700), elements=st.floats(-6e4, 6e4, width=32)), block_size=BLOCKS)
def test_with_fp16_scales_the_bound_is_half_a_scale_as_stored(values: np.ndarray, block_size: int) -> None:
    # An fp16 scale is absmax / 127 rounded up to fp16: 2**-10 relative above 2**-14 (absmax > 0.0078), but up
    # to a fixed 2**-24 below it, which for small gradients (absmax 1e-5, scale 8e-8) is most of the scale:
    # the fp32 scales are the campaign codec's; fp16 ones would save 2 bytes a block, 0.8% at 256.
    decoded = decode_int8(encode_int8(torch.from_numpy(values), block_size, "fp16"), values.size, block_size, "fp16")

    error = np.abs(decoded.numpy().astype(np.float64) - values.astype(np.float64))
    absmax = _blocks_absmax(values, block_size)
    bound = (absmax / 254 * (1 + 2**-10) + 2**-25) * (1 + 2**-20)
    assert (error <= bound).all(), float((error - bound).max())


@given(
    q=arrays(np.int8, st.integers(0, 600), elements=st.integers(-127, 127)),
    exponent=st.integers(-120, 100),
    block_size=BLOCKS,
)
def test_values_on_the_grid_come_back_exactly(q: np.ndarray, exponent: int, block_size: int) -> None:
    # A power-of-two scale makes q * scale exact; each block's absmax is 127 scales, so the grid is the codec's own.
    scale = math.ldexp(1.0, exponent)
    q = q.copy()
    q[::block_size] = 127
    values = torch.from_numpy(q.astype(np.float32) * np.float32(scale))

    decoded = decode_int8(encode_int8(values, block_size), q.size, block_size)

    assert torch.equal(decoded, values)


@pytest.mark.parametrize(("n", "block_size", "expected"), [(0, 256, 0), (1, 256, 5), (256, 256, 260), (257, 256, 265),
                                                          (1000, 32, 1000 + 32 * 4)])  # fmt: skip
def test_the_payload_is_one_byte_per_element_and_one_scale_per_block(n: int, block_size: int, expected: int) -> None:
    codec = get_codec("int8", block_size)

    payload = codec.encode(torch.ones(n))

    assert len(payload) == codec.encoded_size(n) == int8_size(n, block_size) == expected
    assert int8_size(n, block_size, "fp16") == n + -(-n // block_size) * 2


def test_it_stores_the_scales_first_little_endian_then_one_byte_per_value() -> None:
    payload = encode_int8(torch.tensor([127.0, -63.5, 0.0]), 32)

    assert payload == np.float32(1.0).astype("<f4").tobytes() + bytes([127, 256 - 64, 0])  # -63.5 rounds to even


def test_a_single_huge_value_flushes_its_block_but_not_the_next() -> None:
    values = torch.full((64,), 1e-3)
    values[3] = 1e30

    decoded = decode_int8(encode_int8(values, 32), 64, 32)

    assert decoded[3] == pytest.approx(1e30, rel=1e-6)
    assert (decoded[:32][torch.arange(32) != 3] == 0).all()  # under half a scale of 1e30 / 127
    torch.testing.assert_close(decoded[32:], values[32:], rtol=1 / 254, atol=0)


@given(values=VECTORS, block_size=BLOCKS)
def test_the_reconstruction_the_agent_computes_is_what_the_aggregator_decodes(
    values: np.ndarray, block_size: int
) -> None:
    codec = get_codec("int8", block_size)

    payload, reconstructed = codec.encode_and_reconstruct(torch.from_numpy(values))

    assert torch.equal(reconstructed, codec.decode(payload, values.size))
    assert payload == codec.encode(torch.from_numpy(values))


@given(values=VECTORS, cut=st.integers(1, 300))
def test_a_truncated_or_padded_payload_is_refused(values: np.ndarray, cut: int) -> None:
    payload = encode_int8(torch.from_numpy(values))

    with pytest.raises(ProtocolError, match=r"does not hold \d+ elements in blocks of 256 \(\d+ bytes expected\)"):
        decode_int8(payload[:-cut] if len(payload) >= cut else payload + b"\0", values.size)
    with pytest.raises(ProtocolError, match="does not hold"):
        decode_int8(payload + bytes(cut), values.size)


def test_a_payload_cut_into_other_blocks_is_refused_by_length() -> None:
    payload = get_codec("int8", 128).encode(torch.ones(1000))

    with pytest.raises(ProtocolError, match="disagree on the campaign's codec_block_size"):
        get_codec("int8", 256).decode(payload, 1000)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), float("-inf"), -1.0, -(2.0**-24)])
@pytest.mark.parametrize("scales", ["fp32", "fp16"])
def test_a_scale_that_is_not_finite_or_negative_is_refused(scale: float, scales: str) -> None:
    payload = bytearray(encode_int8(torch.ones(300), 256, scales))  # type: ignore[arg-type]
    width = 4 if scales == "fp32" else 2
    payload[width : 2 * width] = np.array([scale], dtype=f"<f{width}").tobytes()  # block 1's scale

    with pytest.raises(ProtocolError, match="the scale of block 1 is"):
        decode_int8(payload, 300, 256, scales)  # type: ignore[arg-type]


def test_a_value_no_encoder_writes_is_refused() -> None:
    payload = bytearray(encode_int8(torch.ones(10)))
    payload[-1] = 0x80  # -128

    with pytest.raises(ProtocolError, match="-128"):
        decode_int8(payload, 10)


def test_a_finite_scale_may_still_overflow_and_the_receiver_sees_inf() -> None:
    payload = bytearray(encode_int8(torch.ones(4)))
    payload[0:4] = np.array([3e38], dtype="<f4").tobytes()

    decoded = decode_int8(payload, 4)

    assert not torch.isfinite(decoded).all()  # the aggregator refuses it as "not finite", like an fp16 overflow


def test_not_finite_input_makes_a_scale_every_receiver_refuses() -> None:
    payload = encode_int8(torch.tensor([1.0, float("nan")]))

    with pytest.raises(ProtocolError, match="scale of block 0 is nan"):
        decode_int8(payload, 2)


@pytest.mark.parametrize("block_size", [31, 0, 1 << 17])
def test_a_block_size_out_of_bounds_is_refused_by_name(block_size: int) -> None:
    with pytest.raises(ProtocolError, match=f"int8 block size {block_size} is out of bounds; choose 32 to 65536"):
        get_codec("int8", block_size)


def test_the_registered_int8_uses_the_default_block_size() -> None:
    codec = get_codec("int8")

    assert codec.block_size == INT8_BLOCK_SIZE == 256 and codec.lossy
    assert get_codec("int8", 64).block_size == 64 and get_codec("fp16", 64).block_size == 0


def test_the_quantized_values_stay_within_plus_minus_127() -> None:
    values = torch.tensor([1.0, -1.0, 0.999999, -1.0000001] * 100)

    q, scale = quantize_int8(values)

    assert int(q.min()) >= -127 and int(q.max()) <= 127 and scale.dtype == torch.float32
