"""How a device computes a lease: the autocast dtype, fp16's loss scale, and microbatches sized to its memory.

A volunteer's GPU holds 8 to 24 GB, and activations, not the model, fill it
first. On CUDA the forward and backward passes run in bf16 autocast (fp16
with a dynamic loss scale on GPUs without bf16), which halves activations and
runs on the tensor cores; parameters and the uploaded gradients stay fp32, so
aggregators add the same numbers whatever computed them. A CPU computes in
fp32 as before: its autocast is slower than fp32 on most processors.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Protocol

import torch

logger = logging.getLogger(__name__)

# The share of a GPU's memory the agent plans to use: the rest is the allocator's slack and other programs'.
MEMORY_FRACTION = 0.85
# fp16's dynamic loss scale: where it starts, and how many clean microbatches double it again.
FIRST_SCALE = 2.0**16
GROWTH_INTERVAL = 200
MIN_SCALE = 1.0


def autocast_dtype(device: torch.device, allowed: bool) -> torch.dtype | None:
    """The dtype a lease computes in on ``device``: bf16 (else fp16) on CUDA if the campaign allows; None: fp32."""
    if not allowed or device.type != "cuda":
        return None
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


class LossScale:
    """fp16's dynamic loss scale: the loss is multiplied before the backward pass so small gradients do not
    underflow, halved when a microbatch's gradient overflows (that microbatch is computed again), and doubled
    after ``GROWTH_INTERVAL`` clean microbatches. bf16 has fp32's range and needs none.
    """

    def __init__(self, scale: float = FIRST_SCALE) -> None:
        self.scale = scale
        self.clean = 0
        self.overflows = 0

    def overflowed(self) -> None:
        """A gradient held inf or NaN: halve the scale.

        Raises:
            FloatingPointError: when even a scale of 1 overflows (the model itself produces inf).
        """
        self.overflows += 1
        self.clean = 0
        if self.scale <= MIN_SCALE:
            raise FloatingPointError(
                "the gradient overflows in fp16 even unscaled; the campaign should turn mixed precision off"
            )
        self.scale = max(MIN_SCALE, self.scale / 2)

    def succeeded(self) -> None:
        self.clean += 1
        if self.clean >= GROWTH_INTERVAL:
            self.scale *= 2
            self.clean = 0


class MemoryProbe(Protocol):
    """A device's memory as the sizing needs it; CUDA's allocator statistics, or a stand-in in tests."""

    def capacity(self) -> int: ...

    def reset_peak(self) -> None: ...

    def allocated(self) -> int: ...

    def peak(self) -> int: ...


@dataclass(frozen=True)
class CudaMemory:
    """The CUDA caching allocator's view of one device."""

    device: torch.device

    def capacity(self) -> int:
        return int(torch.cuda.get_device_properties(self.device).total_memory)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def peak(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))


def memory_probe(device: torch.device) -> MemoryProbe | None:
    """What measures ``device``'s memory; None where there is no wall to size against (a CPU's RAM swaps)."""
    return CudaMemory(device) if device.type == "cuda" else None


def fitting_microbatch(probe: MemoryProbe, baseline: int, measured: int, size: int) -> int:
    """The most samples a microbatch may hold on this device, from one microbatch of ``size`` samples.

    ``baseline`` is what the model held before it (parameters, gradients),
    ``measured`` the peak during it: the difference grows with the samples
    (activations), so ``MEMORY_FRACTION`` of the device, less the baseline,
    holds that many of them.
    """
    per_sample = max(1.0, (measured - baseline) / max(1, size))
    budget = probe.capacity() * MEMORY_FRACTION - baseline
    return max(1, math.floor(budget / per_sample))
