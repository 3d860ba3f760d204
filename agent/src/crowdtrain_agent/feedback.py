"""Error feedback: the rounding error a lossy codec made on one upload of a slice is added to the next one.

Terms: the *residual* of a slice is the gradient the agent meant to send
(its own plus the previous residual) minus what the aggregator's decoder
reconstructs from the bytes. Adding it to the next upload of the same slice
makes the uploads telescope: the sum of everything the aggregators received
differs from the sum of the true gradients by one residual, at most half of
its upload's scale per element (which is at most 254/253 of the gradient's
own: the residual adds to the block's largest value), however many uploads
there were. Without it the rounding
errors of ``int8`` (biased wherever a value sits below half a scale, which
always rounds to zero) add up step after step.

Only ``int8`` gets feedback (``Codec.lossy``): fp16 keeps 11 significant
bits of every value, an error a thousand times smaller than int8's relative
to the block's largest value, and fp32 is exact.

The agent holds residuals for one campaign at a time (a residual is as large
as the slice's gradient, on the gradient's device), and drops them, with a
DEBUG line, when a lease of another campaign, another parameter count or
another codec or block size comes. A verification copy (``ticket.check``) is
encoded without feedback and leaves the residual alone: the aggregator keeps
nothing of a copy, so a residual folded into it would be lost.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

from .codec import Codec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SliceKey:
    """What a residual belongs to: a residual of any other slice, model or codec means nothing."""

    campaign_id: int
    param_count: int
    codec: str
    block_size: int
    start: int
    end: int


class ErrorFeedback:
    """The residuals of one campaign's slices, one per slice; thread-safe (slices encode in worker threads)."""

    def __init__(self) -> None:
        self._residuals: dict[SliceKey, torch.Tensor] = {}
        self._lock = threading.Lock()  # guards the dict; each slice's own lock orders its uploads
        self._slice_locks: dict[SliceKey, threading.Lock] = {}

    def encode(self, key: SliceKey, piece: torch.Tensor, codec: Codec) -> bytes:
        """Encode ``piece`` plus the slice's residual, and keep the new residual for the slice's next upload.

        Two uploads of the same slice encode one after the other, so each takes
        the residual the previous one left. An upload that then fails costs one
        rounding error, never a drift: its residual is still the next one's.

        Args:
            key: the slice, with the campaign, model size and codec it belongs to.
            piece: this upload's gradient of the slice (any device; left unchanged).
            codec: the lease's codec; a codec that is not ``lossy`` is encoded as it is.

        Returns:
            The payload, ``codec.encoded_size(piece.numel())`` bytes.
        """
        if not codec.lossy:
            return codec.encode(piece)
        with self._slice_lock(key):
            residual = self._take(key)
            wanted = piece.detach().to(torch.float32)
            if residual is not None and residual.device == wanted.device:
                wanted = wanted + residual
            payload, sent = codec.encode_and_reconstruct(wanted)
            left = wanted - sent.to(wanted.device)
            # A NaN or infinite gradient is refused by the aggregator; its residual must not spoil the next ones.
            if bool(torch.isfinite(left).all()):
                with self._lock:
                    self._residuals[key] = left
            else:
                logger.debug(
                    "campaign %s slice %s-%s: residual not finite, dropped", key.campaign_id, key.start, key.end
                )
            return payload

    def residual(self, key: SliceKey) -> torch.Tensor | None:
        """The residual the next upload of ``key`` will add (None: none)."""
        with self._lock:
            return self._residuals.get(key)

    def _take(self, key: SliceKey) -> torch.Tensor | None:
        with self._lock:
            stale = [k for k in self._residuals if k != key and _replaces(key, k)]
            for old in stale:
                logger.debug(
                    "error feedback: dropping the residual of campaign %s slice %s-%s (%s, %s params); "
                    "now campaign %s (%s, %s params)",
                    old.campaign_id, old.start, old.end, old.codec, old.param_count,
                    key.campaign_id, key.codec, key.param_count,
                )  # fmt: skip
                del self._residuals[old]
                self._slice_locks.pop(old, None)
            return self._residuals.pop(key, None)

    def _slice_lock(self, key: SliceKey) -> threading.Lock:
        with self._lock:
            return self._slice_locks.setdefault(key, threading.Lock())


def _replaces(new: SliceKey, old: SliceKey) -> bool:
    """Whether a residual of ``old`` is stale once ``new`` is uploaded: another campaign, model or codec."""
    if (new.campaign_id, new.param_count, new.codec, new.block_size) != (
        old.campaign_id,
        old.param_count,
        old.codec,
        old.block_size,
    ):
        return True
    return new.start < old.end and old.start < new.end  # the same campaign cut into other slices
