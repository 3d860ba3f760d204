"""Gradient and parameter codecs: a flat fp32 tensor to bytes on the wire and back.

Codecs come in named pairs (``encode_fp32`` / ``decode_fp32``). Bytes are
little-endian whatever the machine. Decoders check the byte length and return
fp32 tensors that own their memory; finiteness is the receiver's check, since
an fp16 overflow only shows after decoding.

``int8`` is blockwise absmax quantization: the vector is cut into blocks of
``block_size`` elements (the last one may be shorter), each block stored as
one scale, ``absmax / 127``, and one signed byte per element,
``round(x / scale)``. Every decoded element is within half a scale of the
original: ``absmax / 254`` of its block. The agent feeds the rounding error
of one upload into the next (``crowdtrain_agent.feedback``), so the error does
not add up over steps.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Literal

import numpy as np
import torch

from .protocol import ProtocolError


def encode_fp32(flat: torch.Tensor) -> bytes:
    """Raw little-endian float32 bytes of a 1-D tensor (copied to the CPU if needed)."""
    return flat.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4", copy=False).tobytes()


def view_fp32(flat: torch.Tensor) -> memoryview:
    """``encode_fp32``'s bytes without copying them where the tensor already is contiguous CPU fp32."""
    array = flat.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4", copy=False)
    return array.data.cast("B")  # the view keeps the array alive


def decode_fp32(data: bytes | bytearray | memoryview, num_elements: int) -> torch.Tensor:
    """Inverse of ``encode_fp32``.

    Raises:
        ProtocolError: if the length is not 4 * num_elements.
    """
    _check_length(data, num_elements, 4, "fp32")
    return torch.from_numpy(np.frombuffer(data, dtype="<f4").astype(np.float32, copy=True))


def adopt_fp32(data: bytearray, num_elements: int) -> torch.Tensor:
    """``decode_fp32`` for a buffer the caller hands over: the tensor uses its memory, nothing is copied.

    The aggregator reassembles every upload into a fresh buffer; taking it as
    it is saves a pass over megabytes per upload on the CPU the agents share.

    Raises:
        ProtocolError: if the length is not 4 * num_elements.
    """
    _check_length(data, num_elements, 4, "fp32")
    array = np.frombuffer(data, dtype="<f4")
    if sys.byteorder == "big":  # the wire is little-endian
        array = array.astype(np.float32)
    return torch.from_numpy(array)


def encode_fp16(flat: torch.Tensor) -> bytes:
    """Half-precision bytes: half the traffic, ~3 significant digits; values above 65504 become inf."""
    return flat.detach().to("cpu", torch.float16).contiguous().numpy().astype("<f2", copy=False).tobytes()


def view_fp16(flat: torch.Tensor) -> memoryview:
    return memoryview(encode_fp16(flat))


def decode_fp16(data: bytes | bytearray | memoryview, num_elements: int) -> torch.Tensor:
    """Inverse of ``encode_fp16``, widened back to float32.

    Raises:
        ProtocolError: if the length is not 2 * num_elements.
    """
    _check_length(data, num_elements, 2, "fp16")
    return torch.from_numpy(np.frombuffer(data, dtype="<f2").astype(np.float32))


# ------------------------------------------------------------------ int8

INT8_BLOCK_SIZE = 256  # the campaign setting's default (``codec_block_size``)
MIN_INT8_BLOCK_SIZE = 32  # below this the scales cost more than an eighth of the payload
MAX_INT8_BLOCK_SIZE = 1 << 16
ScaleDtype = Literal["fp32", "fp16"]
_SCALE_WIRE = {"fp32": "<f4", "fp16": "<f2"}
_SCALE_TORCH = {"fp32": torch.float32, "fp16": torch.float16}
_SCALE_BITS = {"fp32": torch.int32, "fp16": torch.int16}


def int8_size(num_elements: int, block_size: int = INT8_BLOCK_SIZE, scales: ScaleDtype = "fp32") -> int:
    """Bytes of an int8 payload: one signed byte per element and one scale per block (a short last block too)."""
    return num_elements + -(-num_elements // block_size) * int(_SCALE_WIRE[scales][-1])


def quantize_int8(
    flat: torch.Tensor, block_size: int = INT8_BLOCK_SIZE, scales: ScaleDtype = "fp32"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise absmax quantization of a 1-D tensor, on its own device.

    Args:
        flat: the values; NaN or infinity makes its block's scale NaN or infinite,
            which every receiver refuses.
        block_size: elements per block (the last block may be shorter).
        scales: the scales' width on the wire; the values are rounded against
            the scale as it will be stored, so fp16 scales cost no extra error
            beyond their own rounding.

    Returns:
        ``(q, scale)``: int8 values in ``[-127, 127]``, one per element, and one
        float32 scale per block holding exactly the value the wire will carry.
    """
    x = flat.detach().reshape(-1).to(torch.float32)
    n = x.numel()
    blocks = -(-n // block_size)
    padded = torch.nn.functional.pad(x, (0, blocks * block_size - n)).view(blocks, block_size)
    absmax = padded.abs().amax(dim=1)
    stored = (absmax / 127.0).to(_SCALE_TORCH[scales])
    # Round the stored scale up, never down: then no value needs more than 127 steps, and every error is at
    # most half the scale as stored. (An fp16 scale below 2**-14 moves in steps of 2**-24: rounded to
    # nearest, the block's largest value would lose up to 127 of those, 3.8e-6.) Adding 1 to the bits of
    # a positive float gives the next one up; only the check runs in float64, once per block.
    low = stored.to(torch.float64) * 127.0 < absmax.to(torch.float64)
    bits = _SCALE_BITS[scales]
    stored = torch.where(low, (stored.view(bits) + 1).view(stored.dtype), stored)
    scale = stored.to(torch.float32)
    # Near float32's largest value, 127 times a scale rounded up overflows: take the float below.
    scale = torch.where(torch.isinf(scale * 127.0) & torch.isfinite(scale), torch.nextafter(scale, absmax * 0), scale)
    # Divide rather than multiply by the inverse: the inverse of a subnormal scale overflows to inf.
    # An all-zero block has scale 0 (and 0 / 0 is NaN): its values stay 0.
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(padded / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.view(-1)[:n], scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, block_size: int = INT8_BLOCK_SIZE) -> torch.Tensor:
    """``quantize_int8``'s values back as float32: what a decoder reconstructs, bit for bit."""
    n = q.numel()
    blocks = scale.numel()
    padded = torch.nn.functional.pad(q.to(torch.float32), (0, blocks * block_size - n)).view(blocks, block_size)
    return (padded * scale[:, None]).view(-1)[:n]


def encode_int8(flat: torch.Tensor, block_size: int = INT8_BLOCK_SIZE, scales: ScaleDtype = "fp32") -> bytes:
    """The scales of every block (little-endian), then one signed byte per element.

    ``int8_size(flat.numel(), block_size, scales)`` bytes: about a quarter of fp32's.
    """
    q, scale = quantize_int8(flat, block_size, scales)
    return encode_int8_parts(q, scale, scales)


def encode_int8_parts(q: torch.Tensor, scale: torch.Tensor, scales: ScaleDtype = "fp32") -> bytes:
    """The wire bytes of an already quantized vector (``quantize_int8``'s result)."""
    head = scale.detach().to("cpu").numpy().astype(_SCALE_WIRE[scales]).tobytes()
    return head + q.detach().to("cpu").contiguous().numpy().tobytes()


def decode_int8(
    data: bytes | bytearray | memoryview,
    num_elements: int,
    block_size: int = INT8_BLOCK_SIZE,
    scales: ScaleDtype = "fp32",
) -> torch.Tensor:
    """Inverse of ``encode_int8``; refuses what no encoder writes.

    The product of a finite scale and 127 may still overflow float32: the
    receiver checks the result's finiteness, as for fp16.

    Raises:
        ProtocolError: if the length is not ``int8_size(num_elements, ...)``, a
            scale is NaN, infinite or negative, or a value is -128.
    """
    name = "int8" if scales == "fp32" else "int8 (fp16 scales)"
    expected = int8_size(max(num_elements, 0), block_size, scales)
    if num_elements < 0 or len(data) != expected:
        raise ProtocolError(
            f"{name} payload of {len(data)} bytes does not hold {num_elements} elements in blocks of "
            f"{block_size} ({expected} bytes expected); the agent and the aggregator may disagree on the "
            "campaign's codec_block_size"
        )
    blocks = -(-num_elements // block_size)
    head = blocks * int(_SCALE_WIRE[scales][-1])
    scale = np.frombuffer(data, dtype=_SCALE_WIRE[scales], count=blocks).astype(np.float32)
    bad = ~(scale >= 0)  # NaN compares false: caught here too
    if bad.any() or not np.isfinite(scale).all():
        where = int(np.flatnonzero(bad | ~np.isfinite(scale))[0])
        raise ProtocolError(
            f"{name} payload: the scale of block {where} is {float(scale[where])!r}; scales are finite and "
            "not negative (a NaN or infinite gradient makes such a scale: lower the learning rate)"
        )
    q = np.frombuffer(data, dtype=np.int8, offset=head)
    if (q == -128).any():
        raise ProtocolError(f"{name} payload: a value is -128; encoders write -127 to 127")
    padded = np.zeros(blocks * block_size, dtype=np.float32)
    padded[:num_elements] = q
    grid = padded.reshape(blocks, block_size)
    with np.errstate(over="ignore"):  # an overflow shows as inf, which the receiver refuses
        grid *= scale[:, None]
    return torch.from_numpy(padded[:num_elements])  # a view of ``padded``, which nothing else holds


def _check_length(data: bytes | bytearray | memoryview, num_elements: int, width: int, name: str) -> None:
    if num_elements < 0 or len(data) != num_elements * width:
        raise ProtocolError(
            f"{name} payload of {len(data)} bytes does not hold {num_elements} elements "
            f"({num_elements * width} bytes expected)"
        )


@dataclass(frozen=True)
class Codec:
    """A wire format for flat fp32 vectors: its encoder and decoder, and how many bytes it takes.

    ``encoded_size(n)`` is the exact payload length for ``n`` elements: the
    aggregator expects that many bytes, and the agent cuts that many into chunks.
    """

    name: str
    bytes_per_element: int  # the width of one value; int8 adds one scale per block (``encoded_size``)
    encode: Callable[[torch.Tensor], bytes]
    decode: Callable[[bytes | bytearray | memoryview, int], torch.Tensor]
    view: Callable[[torch.Tensor], memoryview]  # the same bytes as encode, without a copy where possible
    adopt: Callable[[bytearray, int], torch.Tensor]  # decode a buffer the caller gives away, in place where possible
    block_size: int = 0  # int8: elements per scale; 0 for codecs without blocks
    # Rounding error worth feeding back into the next upload (``crowdtrain_agent.feedback``): int8's is a
    # few tenths of a percent of each block's largest value; fp16's, 2**-11 of each value, is left alone.
    lossy: bool = False
    encoded_size: Callable[[int], int] = field(default=lambda n: 4 * n)

    def encode_and_reconstruct(self, flat: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        """The payload of ``flat``, and what the receiver's decoder will make of it, bit for bit.

        For int8 the reconstruction is computed where ``flat`` is (on the GPU, say),
        from the same quantization as the bytes: no decode pass.
        """
        if self.block_size:
            q, scale = quantize_int8(flat, self.block_size)
            return encode_int8_parts(q, scale), dequantize_int8(q, scale, self.block_size)
        data = self.encode(flat)
        return data, self.decode(data, flat.numel())


def _int8_codec(block_size: int) -> Codec:
    def encode(flat: torch.Tensor) -> bytes:
        return encode_int8(flat, block_size)

    def decode(data: bytes | bytearray | memoryview, num_elements: int) -> torch.Tensor:
        return decode_int8(data, num_elements, block_size)

    return Codec(
        "int8",
        1,
        encode,
        decode,
        lambda flat: memoryview(encode(flat)),
        decode,  # scales the bytes into a new float32 buffer anyway
        block_size=block_size,
        lossy=True,
        encoded_size=lambda n: int8_size(n, block_size),
    )


CODECS: dict[str, Codec] = {
    "fp32": Codec("fp32", 4, encode_fp32, decode_fp32, view_fp32, adopt_fp32),
    "fp16": Codec(
        "fp16", 2, encode_fp16, decode_fp16, view_fp16, decode_fp16, encoded_size=lambda n: 2 * n
    ),  # widening copies anyway
    "int8": _int8_codec(INT8_BLOCK_SIZE),
}


def get_codec(name: str, block_size: int = INT8_BLOCK_SIZE) -> Codec:
    """Look up a codec by its wire name.

    Args:
        name: the codec's wire name, a key of ``CODECS``.
        block_size: elements per scale, for ``int8`` (the lease's
            ``codec_block_size``); other codecs ignore it.

    Raises:
        ProtocolError: for a codec this version does not know, or a block size
            outside ``MIN_INT8_BLOCK_SIZE`` to ``MAX_INT8_BLOCK_SIZE``.
    """
    try:
        codec = CODECS[name]
    except KeyError:
        raise ProtocolError(f"unknown codec {name!r}; known codecs: {', '.join(CODECS)}") from None
    if codec.block_size and block_size != codec.block_size:
        return _blocked(name, block_size)
    return codec


@cache
def _blocked(name: str, block_size: int) -> Codec:
    if not MIN_INT8_BLOCK_SIZE <= block_size <= MAX_INT8_BLOCK_SIZE:
        raise ProtocolError(
            f"{name} block size {block_size} is out of bounds; choose {MIN_INT8_BLOCK_SIZE} to {MAX_INT8_BLOCK_SIZE}"
        )
    return _int8_codec(block_size)
