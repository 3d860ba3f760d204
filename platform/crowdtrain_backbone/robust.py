"""Robust aggregation: norm clipping against a slice's running median, coordinate-wise trimmed mean, centered clipping.

Terms: a *contribution* is one committed upload of a slice. Its *per-sample
norm* is ``||grad|| * scale / num_samples``, its *per-lease mean*
``grad * scale / num_samples``. The *clip history* is the per-sample norms of
the slice's last ``CLIP_WINDOW`` contributions, kept in its checkpoints.

Everything here is a function of the committed uploads in lease-id order and
of the clip history: never of arrival order or the clock, so replicas and
reruns of a step agree bit for bit. The robust rules count each lease as one
vote, whatever its size: lease sizes follow the speed a device reports, so a
weight by samples would be a weight an attacker chooses.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from crowdtrain_agent.protocol import SliceAssignment, trim_count

from .aggregation import AggregationRule, MeanRule, PendingUpload

__all__ = [
    "CLIP_WINDOW",
    "CenteredClipRule",
    "ClipHistory",
    "Clipping",
    "TrimmedMeanRule",
    "build_rule",
    "clip_contributions",
    "trim_count",
    "vector_norm",
]

logger = logging.getLogger(__name__)

# Contributions of earlier steps the clipping median looks back over (this step's are added to them).
# 64 spans several steps of a busy campaign, so one step's uploads cannot make the median alone, and is
# short enough to follow the gradient norm as training moves on (it falls by orders of magnitude).
CLIP_WINDOW = 64
# Elements of one gradient a norm reads in float64 at a time: a bounded copy, never the whole slice.
NORM_CHUNK = 1 << 16
# Elements of one (leases x columns) block the robust rules stack and sort at once (16 MiB of fp32, plus
# the sort's values and int64 indices): a slice of tens of millions of elements is never stacked whole.
BLOCK_ELEMENTS = 1 << 22
# Centered clipping's rounds from the coordinate-wise median; each reads every contribution once.
CENTERED_CLIP_ITERATIONS = 3
# Below this many contributions there is no majority to be robust with: the robust rules take the mean.
MIN_ROBUST_CONTRIBUTIONS = 3


def vector_norm(t: torch.Tensor) -> float:
    """``||t||``, summed in float64 over fixed chunks and rounded to 9 significant digits.

    Clip decisions compare norms, so a decision must not flip between two
    replicas whose BLAS splits a reduction differently (another thread
    count): float64 sums differ in their last bits at most, which the
    rounding removes.
    """
    total = 0.0
    for chunk in t.reshape(-1).split(NORM_CHUNK):
        wide = chunk.double()
        total += float(wide.dot(wide))
    return float(f"{math.sqrt(total):.9g}")


# ------------------------------------------------------------------ norm clipping


class ClipHistory:
    """The per-sample norms (after clipping) of a slice's last ``CLIP_WINDOW`` contributions, oldest first.

    It goes into every checkpoint of the slice: a slice restored to version
    ``v`` clips the next step exactly as the run did at ``v``.
    """

    def __init__(self, norms: Iterable[float] = ()) -> None:
        self.norms: deque[float] = deque(norms, maxlen=CLIP_WINDOW)

    def record_(self, norms: Iterable[float]) -> None:
        self.norms.extend(norms)

    def to_list(self) -> list[float]:
        """A copy for a checkpoint: the deque goes on changing with later steps."""
        return list(self.norms)

    @classmethod
    def from_saved(cls, saved: Any) -> ClipHistory:
        """The history a checkpoint holds (a list of positive finite floats).

        Raises:
            ValueError: saying what is wrong with it.
        """
        if not isinstance(saved, list):
            raise ValueError(f"the clip history is a {type(saved).__name__}, not a list of norms")
        for value in saved:
            if isinstance(value, bool) or not isinstance(value, float | int) or not 0 < value < math.inf:
                raise ValueError(f"the clip history holds {value!r:.40}, not a positive finite norm")
        return cls(float(v) for v in saved)


@dataclass(frozen=True)
class Clipping:
    """What clipping did to one step's contributions.

    ``uploads``: what the rule combines, a clipped one as a copy carrying its
    ``scale`` (the held tensor is shared, never changed). ``recorded``: the
    per-sample norms the history keeps, after clipping, zeros left out.
    ``bound``: the largest per-sample norm let through (None: clipping off).
    """

    uploads: list[PendingUpload]
    recorded: list[float]
    clipped: list[int]
    median: float | None = None
    bound: float | None = None


def clip_contributions(uploads: Sequence[PendingUpload], history: ClipHistory, clip_factor: float) -> Clipping:
    """Clip each contribution's per-sample norm to ``clip_factor`` times the median of the recent ones.

    The median is over the history (earlier steps) and this step's norms:
    the first steps of a campaign have only their own. Zero norms are left
    out of it (a contribution that never touched this part of the model says
    nothing about its scale; an embedding table of rare tokens is mostly
    zeros). What the history records is the norm after clipping, so a burst
    of huge uploads cannot drag the median up for the steps after it.

    Args:
        uploads: the step's uploads in ascending lease-id order.
        history: the slice's clip history; not changed here (``record_`` it once the step is applied).
        clip_factor: the multiple of the median let through; 0 (or less) disables clipping.

    Returns:
        The uploads to combine, and what to log and record.
    """
    if clip_factor <= 0:
        return Clipping(list(uploads), [], [])
    norms = [_norm_then_release(u) * u.scale / u.num_samples for u in uploads]
    window = [*history.norms, *(n for n in norms if n > 0)]
    if not window:
        return Clipping(list(uploads), [], [])
    median = statistics.median(window)
    bound = clip_factor * median
    kept: list[PendingUpload] = []
    recorded: list[float] = []
    clipped: list[int] = []
    for upload, norm in zip(uploads, norms, strict=True):
        if norm > bound:
            kept.append(replace(upload, scale=upload.scale * bound / norm))
            clipped.append(upload.lease_id)
            recorded.append(bound)
        else:
            kept.append(upload)
            if norm > 0:
                recorded.append(norm)
    return Clipping(kept, recorded, clipped, median, bound)


def _norm_then_release(upload: PendingUpload) -> float:
    norm = vector_norm(upload.grad)
    upload.release_pages()
    return norm


# ------------------------------------------------------------------ robust means


def _weights(uploads: Sequence[PendingUpload]) -> list[float]:
    """What turns each upload into its per-lease mean (its clipping scale included)."""
    return [u.scale / u.num_samples for u in uploads]


def _by_blocks(uploads: Sequence[PendingUpload], reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Apply ``reduce`` to (leases x columns) blocks of the per-lease means and join the columns it returns.

    A coordinate's result depends on that coordinate alone, so cutting the
    columns into blocks changes nothing but the memory held: one block, not
    a copy of every upload.
    """
    weights = _weights(uploads)
    numel = uploads[0].grad.numel()
    columns = max(1, BLOCK_ELEMENTS // len(uploads))
    out = torch.empty(numel, dtype=torch.float32)
    block = torch.empty(len(uploads), min(columns, numel), dtype=torch.float32)
    for lo in range(0, numel, columns):
        hi = min(lo + columns, numel)
        rows = block[:, : hi - lo]
        for row, upload, weight in zip(rows, uploads, weights, strict=True):
            torch.mul(upload.grad[lo:hi], weight, out=row)
            upload.release_pages(lo, hi)  # a block of each spooled upload resident, never all of them
        out[lo:hi] = reduce(rows)
    return out


def _mean_of_sorted(ordered: torch.Tensor, first: int, stop: int) -> torch.Tensor:
    """Mean of rows ``first:stop``, added in row order (a fixed order: fp32 addition is not associative)."""
    total = ordered[first].clone()
    for row in ordered[first + 1 : stop]:
        total.add_(row)
    return total.div_(stop - first)


def _coordinate_median(rows: torch.Tensor) -> torch.Tensor:
    """Each column's median; with an even count the mean of the two middle values (torch's is the lower)."""
    ordered = rows.sort(dim=0).values
    n = rows.shape[0]
    return _mean_of_sorted(ordered, (n - 1) // 2, n // 2 + 1)


class TrimmedMeanRule(AggregationRule):
    """Coordinate-wise trimmed mean of the per-lease means.

    For each coordinate, the ``trim_count`` largest and smallest values are
    dropped and the rest averaged: a minority of arbitrary contributions moves
    no coordinate beyond the range of the honest ones. With too few
    contributions to drop any (trim fraction times count below 1) it is the
    plain mean, and a log line says so.
    """

    name = "trimmed_mean"

    def __init__(self, trim_fraction: float) -> None:
        self.trim_fraction = trim_fraction

    def combine(self, uploads: Sequence[PendingUpload], num_samples: int) -> torch.Tensor:
        count = len(uploads)
        trim = trim_count(count, self.trim_fraction)
        if trim == 0:
            logger.info(
                "trimmed mean of %s contributions at trim fraction %g would drop none; taking the plain mean",
                count,
                self.trim_fraction,
            )
            return MeanRule().combine(uploads, num_samples)
        return _by_blocks(uploads, lambda rows: _mean_of_sorted(rows.sort(dim=0).values, trim, count - trim))


class CenteredClipRule(AggregationRule):
    """Centered clipping (Karimireddy, He and Jaggi, ICML 2021) of the per-lease means.

    From a robust start ``v`` (the coordinate-wise median), each round moves
    ``v`` by the mean of the contributions' differences from it, each
    difference clipped to norm ``tau``: ``v <- v + mean_i clip(x_i - v, tau)``.
    An outlier pulls by at most ``tau / n`` per round. ``tau`` is the median
    distance of the contributions from the start, fixed for every round: a
    scale the honest majority sets, with no setting to tune. Fewer than 3
    contributions have no majority: the plain mean, said in a log line.
    """

    name = "centered_clip"

    def __init__(self, iterations: int = CENTERED_CLIP_ITERATIONS) -> None:
        self.iterations = iterations

    def combine(self, uploads: Sequence[PendingUpload], num_samples: int) -> torch.Tensor:
        count = len(uploads)
        if count < MIN_ROBUST_CONTRIBUTIONS:
            logger.info("centered clipping of %s contributions has no majority; taking the plain mean", count)
            return MeanRule().combine(uploads, num_samples)
        weights = _weights(uploads)
        center = _by_blocks(uploads, _coordinate_median)
        # One difference at a time: memory is three slices (center, step, difference) whatever the count.
        tau = statistics.median(
            _released(u, vector_norm(torch.mul(u.grad, w).sub_(center))) for u, w in zip(uploads, weights, strict=True)
        )
        if tau == 0:
            return center  # most contributions sit on the median: it is the answer
        for _ in range(self.iterations):
            step = torch.zeros_like(center)
            for upload, weight in zip(uploads, weights, strict=True):
                diff = torch.mul(upload.grad, weight).sub_(center)
                upload.release_pages()
                distance = vector_norm(diff)
                if not math.isfinite(distance):
                    continue  # values near the fp32 limit overflowed: no direction to clip along
                step.add_(diff, alpha=min(1.0, tau / distance) if distance > 0 else 1.0)
            center.add_(step.div_(count))
        return center


def _released(upload: PendingUpload, value: float) -> float:
    """``value``, once ``upload``'s pages (read to compute it) have left the resident set."""
    upload.release_pages()
    return value


def build_rule(assignment: SliceAssignment) -> AggregationRule:
    """The rule a campaign chose (``assign.aggregation``); the plain mean unless it said otherwise."""
    if assignment.aggregation == "trimmed_mean":
        return TrimmedMeanRule(assignment.trim_fraction)
    if assignment.aggregation == "centered_clip":
        return CenteredClipRule()
    return MeanRule()
