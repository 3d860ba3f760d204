"""The aggregation interface: pending uploads, the rule that combines a step's uploads, and the plain mean.

Terms: a *pending upload* is one lease's gradient for a slice, summed over
the lease's samples, held until the site commits a step that names it. Its
*scale* is what norm clipping (``robust.clip_contributions``) multiplies it
by at commit time; the held tensor itself is never changed.
"""

from __future__ import annotations

import mmap
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .spool import release_pages

__all__ = ["AggregationRule", "MeanRule", "PendingUpload"]

# Elements of each upload a pass reads between two releases of their pages (16 MiB of fp32).
PIECE_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class PendingUpload:
    """One lease's gradient for this slice, summed over its ``num_samples`` samples.

    ``scale`` (at most 1) is set only on the copy a commit combines, when the
    contribution was clipped: the contribution is then ``grad * scale``.
    ``pages`` is set when ``grad`` is a mapping of a spooled file
    (``crowdtrain_backbone.spool``): a pass that read it calls
    ``release_pages`` so the process does not keep what it read.
    """

    lease_id: int
    base_version: int
    num_samples: int
    grad: torch.Tensor
    scale: float = 1.0
    pages: mmap.mmap | None = field(default=None, compare=False, repr=False)

    @property
    def nbytes(self) -> int:
        return self.grad.numel() * self.grad.element_size()

    def release_pages(self, start: int = 0, end: int | None = None) -> None:
        """Done reading elements ``start:end`` (all by default) for now: a spooled gradient's pages leave the
        resident set (nothing for one in memory)."""
        if start == 0 and end is None:
            release_pages(self.pages)
        else:
            stop = self.grad.numel() if end is None else end
            release_pages(self.pages, start * 4, (stop - start) * 4)


class AggregationRule(ABC):
    """How the pending uploads named by one commit become the step's gradient."""

    name: str = ""

    @abstractmethod
    def combine(self, uploads: Sequence[PendingUpload], num_samples: int) -> torch.Tensor:
        """Return the per-sample gradient for the step.

        Args:
            uploads: the committed uploads, already in ascending lease-id order;
                rules must keep that order so replicas agree bit for bit. Each
                contributes ``grad * scale``; the tensors must not be changed.
            num_samples: the step's sample count (sum of the uploads' counts).
        """


class MeanRule(AggregationRule):
    """Sum of the lease gradients divided by the sample count: the big-batch mean-loss gradient."""

    name = "mean"

    def combine(self, uploads: Sequence[PendingUpload], num_samples: int) -> torch.Tensor:
        # Piece by piece: each element is still ((g1 + g2) + g3 ...) / n in lease-id order (fp32 addition is
        # not associative), but only a piece of each spooled upload is resident at a time, not whole uploads.
        # Pending uploads stay untouched: a commit that fails after this can be sent again and must find them.
        numel = uploads[0].grad.numel()
        total = torch.empty(numel, dtype=torch.float32)
        scaled = any(u.scale != 1.0 for u in uploads)
        for start in range(0, numel, PIECE_ELEMENTS):
            end = min(numel, start + PIECE_ELEMENTS)
            piece = total[start:end]
            if scaled:  # a step where clipping cut a contribution
                torch.mul(uploads[0].grad[start:end], uploads[0].scale, out=piece)
                for upload in uploads[1:]:
                    piece.add_(upload.grad[start:end], alpha=upload.scale)
            elif len(uploads) == 1:
                piece.copy_(uploads[0].grad[start:end])
            else:  # no zero-filled start: the first sum makes the piece
                torch.add(uploads[0].grad[start:end], uploads[1].grad[start:end], out=piece)
                for upload in uploads[2:]:
                    piece.add_(upload.grad[start:end])
            piece.div_(float(num_samples))
            for upload in uploads:
                upload.release_pages(start, end)
        return total
