"""Gradient and parameter codecs: a flat fp32 tensor to bytes on the wire and back.

Codecs come in named pairs (``encode_fp32`` / ``decode_fp32``). Bytes are
little-endian whatever the machine. Decoders check the byte length and return
fp32 tensors that own their memory; finiteness is the receiver's check, since
an fp16 overflow only shows after decoding.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

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


def _check_length(data: bytes | bytearray | memoryview, num_elements: int, width: int, name: str) -> None:
    if num_elements < 0 or len(data) != num_elements * width:
        raise ProtocolError(
            f"{name} payload of {len(data)} bytes does not hold {num_elements} elements "
            f"({num_elements * width} bytes expected)"
        )


@dataclass(frozen=True)
class Codec:
    name: str
    bytes_per_element: int
    encode: Callable[[torch.Tensor], bytes]
    decode: Callable[[bytes | bytearray | memoryview, int], torch.Tensor]
    view: Callable[[torch.Tensor], memoryview]  # the same bytes as encode, without a copy where possible
    adopt: Callable[[bytearray, int], torch.Tensor]  # decode a buffer the caller gives away, in place where possible


CODECS: dict[str, Codec] = {
    "fp32": Codec("fp32", 4, encode_fp32, decode_fp32, view_fp32, adopt_fp32),
    "fp16": Codec("fp16", 2, encode_fp16, decode_fp16, view_fp16, decode_fp16),  # widening copies anyway
}


def get_codec(name: str) -> Codec:
    """Look up a codec by its wire name.

    Raises:
        ProtocolError: for a codec this version does not know.
    """
    try:
        return CODECS[name]
    except KeyError:
        raise ProtocolError(f"unknown codec {name!r}; known codecs: {', '.join(CODECS)}") from None
