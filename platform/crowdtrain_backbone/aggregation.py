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

    def release_pages(self) -> None:
        """Done reading for now: a spooled gradient's pages leave the resident set (nothing for one in memory)."""
        release_pages(self.pages)


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
        if any(u.scale != 1.0 for u in uploads):
            return _scaled_sum(uploads).div_(float(num_samples))
        # One pass per upload and no zero-filled start: the first sum (or the lone upload, a whole-step
        # lease) makes the new tensor. Pending uploads stay untouched: a commit that fails after this can
        # be sent again and must find them as they were.
        if len(uploads) == 1:
            total = uploads[0].grad / float(num_samples)
            uploads[0].release_pages()
            return total
        total = uploads[0].grad + uploads[1].grad
        uploads[0].release_pages()
        uploads[1].release_pages()
        for upload in uploads[2:]:  # fixed order: fp32 addition is not associative
            total.add_(upload.grad)
            upload.release_pages()  # one spooled upload resident at a time, whatever the count
        return total.div_(float(num_samples))


def _scaled_sum(uploads: Sequence[PendingUpload]) -> torch.Tensor:
    """Sum of ``grad * scale`` in the given order: the path of a step where clipping cut a contribution."""
    total = uploads[0].grad * uploads[0].scale
    uploads[0].release_pages()
    for upload in uploads[1:]:
        total.add_(upload.grad, alpha=upload.scale)
        upload.release_pages()
    return total
