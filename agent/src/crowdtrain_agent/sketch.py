"""Gradient sketches: a few hundred numbers that let the site tell whether two agents computed the same gradient.

A lease picked for verification is also given to a volunteer of another
account. The *aggregators* sketch every slice they receive and sign the sketch
into the upload's receipt; the agent relays the receipts with ``done`` and the
site compares the two leases' sketches without ever seeing the gradients. The
agent never sketches: a sketch it computed itself could describe an honest
gradient while it uploads another.

The seed is secret (derived from the campaign's ticket key, which agents never
see) and changes with every parameter version, so an agent cannot learn which
coordinates a sketch reads and spoil only the others. Past ``coordinates``
elements, a sketch reads that many coordinates drawn at random, which keeps its
cost fixed for any model size.

The sketch is a count sketch: every coordinate is added, with a random sign, to
one of ``size`` buckets, both drawn from a generator seeded by the lease. It is a
random linear map, so it keeps inner products and norms up to a small error
(the Johnson-Lindenstrauss property), costs one pass over the gradient, and needs
no matrix. Two honest agents' sketches differ only by floating-point noise (fp16
transport, another GPU's reduction order); a scaled, sign-flipped, noisy or
zeroed gradient changes the direction or the norm of its sketch.

The comparison is plain Python, so the site needs no torch for it.
"""

from __future__ import annotations

import array
import hashlib
import hmac
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SKETCH_SIZE = 256
# Coordinates a sketch reads from a larger gradient: about a millisecond of work; a hostile gradient
# that differs from the honest one in more than a few hundred of a million coordinates shows.
SKETCH_COORDINATES = 1 << 16
# Coordinates drawn per generator call: fixed, so every device draws the same buckets and signs.
CHUNK = 1 << 20


def sketch_seed(key: bytes, slice_index: int, base_version: int) -> int:
    """The seed for sketches of one slice's gradients trained on ``base_version``: the same on every aggregator."""
    digest = hmac.new(key, b"crowdtrain sketch %d %d" % (slice_index, base_version), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def sketch(grad: torch.Tensor, seed: int, size: int = SKETCH_SIZE, coordinates: int | None = None) -> list[float]:
    """The count sketch of a flat gradient under ``seed`` (the same on every device and thread count).

    With ``coordinates`` smaller than the gradient, only that many coordinates
    (drawn with the seed) are read.
    """
    import torch

    flat = grad.detach().reshape(-1)
    if coordinates is not None and coordinates < flat.numel():
        generator = torch.Generator().manual_seed((seed * 7_919 + 17) % (1 << 63))
        flat = flat[torch.randint(0, flat.numel(), (coordinates,), generator=generator)]
    flat = flat.to("cpu", torch.float64)
    out = torch.zeros(size, dtype=torch.float64)
    for index, start in enumerate(range(0, flat.numel(), CHUNK)):
        piece = flat[start : start + CHUNK]
        generator = torch.Generator().manual_seed((seed * 1_000_003 + index) % (1 << 63))
        buckets = torch.randint(0, size, (piece.numel(),), generator=generator)
        signs = torch.randint(0, 2, (piece.numel(),), generator=generator, dtype=torch.int8).to(torch.float64)
        out.index_add_(0, buckets, piece * (2 * signs - 1))
    return out.tolist()


def to_bytes(values: Sequence[float]) -> bytes:
    """A sketch as little-endian float32 bytes: what a receipt carries (1 KiB for 256 numbers)."""
    packed = array.array("f", values)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def from_bytes(data: bytes) -> list[float]:
    """The numbers of ``to_bytes``.

    Raises:
        ValueError: the bytes are not whole float32 numbers.
    """
    if len(data) % 4:
        raise ValueError(f"a sketch is float32 numbers; {len(data)} bytes is not a whole number of them")
    packed = array.array("f")
    packed.frombytes(data)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tolist()


@dataclass(frozen=True)
class Agreement:
    """How two sketches compare: the cosine of their angle and the ratio of their norms (smaller over larger)."""

    cosine: float
    norm_ratio: float

    def agrees(self, min_cosine: float = 0.99, min_norm_ratio: float = 0.95) -> bool:
        """Within a tolerance that fp16 transport and another device's arithmetic stay inside."""
        return self.cosine >= min_cosine and self.norm_ratio >= min_norm_ratio


def compare(a: Sequence[float], b: Sequence[float]) -> Agreement:
    """Compare two sketches of the same size; a zero or non-finite sketch agrees with nothing.

    Raises:
        ValueError: the sketches differ in size.
    """
    if len(a) != len(b):
        raise ValueError(f"sketches of {len(a)} and {len(b)} numbers cannot be compared")
    if not all(math.isfinite(x) for x in (*a, *b)):
        return Agreement(cosine=-1.0, norm_ratio=0.0)
    norm_a = math.sqrt(math.fsum(x * x for x in a))
    norm_b = math.sqrt(math.fsum(x * x for x in b))
    if norm_a == 0.0 or norm_b == 0.0:  # no work shows as zero; two zeros would let idle colluders agree
        return Agreement(cosine=-1.0, norm_ratio=0.0)
    cosine = math.fsum(x * y for x, y in zip(a, b, strict=True)) / (norm_a * norm_b)
    return Agreement(cosine=max(-1.0, min(1.0, cosine)), norm_ratio=min(norm_a, norm_b) / max(norm_a, norm_b))
