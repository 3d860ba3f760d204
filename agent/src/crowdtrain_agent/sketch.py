"""Gradient sketches: a few hundred numbers that let the site tell whether two agents computed the same gradient.

Groundwork for verification (issue 12): a lease picked for verification is also
given to a second volunteer, and each agent sends a sketch of its gradient with
``done``; the site compares the two without ever seeing the gradients.

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

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SKETCH_SIZE = 256
# Coordinates drawn per generator call: fixed, so every device draws the same buckets and signs.
CHUNK = 1 << 20


def sketch(grad: torch.Tensor, seed: int, size: int = SKETCH_SIZE) -> list[float]:
    """The count sketch of a flat gradient under ``seed`` (the same on every device and thread count)."""
    import torch

    flat = grad.detach().reshape(-1).to("cpu", torch.float64)
    out = torch.zeros(size, dtype=torch.float64)
    for index, start in enumerate(range(0, flat.numel(), CHUNK)):
        piece = flat[start : start + CHUNK]
        generator = torch.Generator().manual_seed((seed * 1_000_003 + index) % (1 << 63))
        buckets = torch.randint(0, size, (piece.numel(),), generator=generator)
        signs = torch.randint(0, 2, (piece.numel(),), generator=generator, dtype=torch.int8).to(torch.float64)
        out.index_add_(0, buckets, piece * (2 * signs - 1))
    return out.tolist()


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
