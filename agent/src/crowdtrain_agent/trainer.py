"""The model of each campaign and the gradient of one lease: plain PyTorch, no networking."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from .data import ShardReader, augment_images, sample_seed
from .models import ModelEntry, get_model
from .precision import LossScale, MemoryProbe, autocast_dtype, fitting_microbatch, memory_probe
from .protocol import ModelSpec, SampleRange

logger = logging.getLogger(__name__)


class ComputeCancelled(RuntimeError):
    """The agent is stopping now; the lease's gradient was abandoned half way."""


@dataclass
class CampaignModel:
    """A campaign's model on the compute device and the parameter version it holds."""

    spec: ModelSpec
    entry: ModelEntry
    model: nn.Module
    param_count: int
    version: int | None = None  # None until parameters were loaded
    etags: tuple[str, ...] = ()  # of each slice's publication of that version (a rollback republishes it)
    # Learned from out-of-memory errors on this device (``compute_gradient``): activation checkpointing
    # switched on, the most samples a microbatch may hold (None: the lease's), and how often it ran out.
    checkpointing: bool = False
    microbatch_cap: int | None = None
    out_of_memory: int = 0
    # Set once the first microbatch's peak memory sized this device's microbatches (``precision``).
    memory_measured: bool = False
    loss_scale: LossScale = field(default_factory=LossScale)  # fp16 autocast only
    fp16_failed: bool = False  # fp16 overflowed even unscaled on this device: it computes in fp32 from then on


class ModelCache:
    """One built model per campaign, rebuilt only when the campaign's model spec changes.

    Keeping the model (and the version loaded into it) means a second lease
    at the same version downloads and copies nothing.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._models: dict[int, CampaignModel] = {}

    def get(self, campaign_id: int, spec: ModelSpec) -> CampaignModel:
        """The campaign's model for ``spec``, built on first use.

        Raises:
            ModelConfigError: for an architecture or config this agent cannot build.
        """
        cached = self._models.get(campaign_id)
        if cached is not None and cached.spec == spec:
            return cached
        entry = get_model(spec.architecture)
        model = entry.build(spec.config).to(self.device)
        model.train()
        param_count = sum(p.numel() for p in model.parameters())
        cached = CampaignModel(spec=spec, entry=entry, model=model, param_count=param_count)
        self._models[campaign_id] = cached
        logger.debug("built %s for campaign %d: %d parameters", spec.architecture, campaign_id, param_count)
        return cached

    def holds(self, campaign_id: int, spec: ModelSpec, version: int) -> bool:
        """Whether the campaign's model already holds parameter ``version``."""
        cached = self._models.get(campaign_id)
        return cached is not None and cached.spec == spec and cached.version == version


def model_device(cm: CampaignModel) -> torch.device:
    return next(cm.model.parameters()).device


def load_params_(cm: CampaignModel, flat: torch.Tensor, version: int, etags: Sequence[str] = ()) -> None:
    """Copy a flat parameter vector (parameters_to_vector order) into the model, in place."""
    if flat.numel() != cm.param_count:
        raise ValueError(
            f"parameter vector has {flat.numel()} elements but {cm.spec.architecture} has {cm.param_count}; "
            "the campaign may need a newer crowdtrain-agent"
        )
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(flat.to(model_device(cm)), cm.model.parameters())
    cm.version = version
    cm.etags = tuple(etags)


def gather_samples(
    ranges: Sequence[SampleRange], readers: dict[str, ShardReader], *, augment: str = "none", version: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of every range of a lease, concatenated in lease order.

    Raises:
        ProtocolError: if a range lies outside its shard, or samples are not images to augment.
    """
    parts = [read_range(r, readers[r.shard], augment=augment, version=version) for r in ranges]
    if len(parts) == 1:
        return parts[0]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def read_range(
    r: SampleRange, reader: ShardReader, *, augment: str = "none", version: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of one range of a lease.

    With ``augment`` each image is changed as the seed of its sample and the
    lease's base ``version`` say, so a verification copy sees the same images.

    Raises:
        ProtocolError: if the range lies outside its shard, or its samples are not images to augment.
    """
    x, y = reader.read(r.start, r.count)
    if augment != "none":
        x = augment_images(x, augment, [sample_seed(r.shard, r.start + i, version) for i in range(r.count)])
    return x, y


class SamplesUnavailable(RuntimeError):
    """A later range of a lease could not be read (its shard failed to download); the lease is given back."""


class GradientNotFinite(RuntimeError):
    """A lease's gradient holds NaN or infinite values (the model diverged on its samples); it is given back.

    Never uploaded: the aggregators would refuse it, and a refused upload counts
    against the volunteer's standing, as a made-up one would.
    """


# The largest magnitude a codec carries; past it the value arrives infinite (fp16 overflows to inf).
CODEC_RANGE = {"fp16": float(torch.finfo(torch.float16).max)}


def finite_or_raise(grad: torch.Tensor, codec: str = "fp32") -> None:
    """Raise ``GradientNotFinite`` for a gradient an aggregator would refuse as sent in ``codec``; one pass otherwise.

    Raises:
        GradientNotFinite: naming how many values are NaN or infinite, or how large they got for the codec.
    """
    limit = CODEC_RANGE.get(codec)
    if math.isfinite(float(grad.sum(dtype=torch.float64))):
        # A NaN or an infinity anywhere makes the sum one: no mask of the whole gradient needed.
        if limit is not None:
            low, high = torch.aminmax(grad)
            largest = max(-float(low), float(high))
            if largest > limit:
                raise GradientNotFinite(
                    f"gradient values reach {largest:.4g}, past the {limit:.4g} the {codec} codec carries (they "
                    "would arrive infinite; the model is diverging, or the learning rate is too high); nothing uploaded"
                )
        return
    finite = torch.isfinite(grad)
    if not bool(finite.all()):
        bad = int(finite.numel() - int(finite.sum()))
        raise GradientNotFinite(
            f"{bad} of {grad.numel()} gradient values are NaN or infinite (the model diverged on these samples, "
            "or the learning rate is too high); nothing uploaded"
        )


class ArrivingSamples:
    """A lease's inputs and targets, filled range by range while the compute reads the rows already there.

    A lease over several shards starts computing once its first range is
    read; later shards download meanwhile (``put`` from another thread), and
    a microbatch waits only for the rows it needs (``wait``). The rows are
    the same, in the same order, as ``gather_samples`` makes them, so the
    gradient is too.

    Args:
        num_samples: the lease's samples, every range together.
        first: the first range's inputs and targets.
    """

    def __init__(self, num_samples: int, first: tuple[torch.Tensor, torch.Tensor]) -> None:
        x0, y0 = first
        self.x = torch.empty((num_samples, *x0.shape[1:]), dtype=x0.dtype)
        self.y = torch.empty((num_samples, *y0.shape[1:]), dtype=y0.dtype)
        self.filled = 0
        self.waited_s = 0.0  # time the compute spent waiting for rows: not the device's compute time
        self._error: str | None = None
        self._arrived = threading.Condition()
        self.put(x0, y0)

    def put(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """The next range's rows (any thread).

        Raises:
            ValueError: rows of another shape than the first range's, or more rows than the lease has.
        """
        end = self.filled + len(x)
        if len(y) != len(x) or end > len(self.x) or x.shape[1:] != self.x.shape[1:] or y.shape[1:] != self.y.shape[1:]:
            raise ValueError(
                f"a range of {len(x)} samples shaped {tuple(x.shape[1:])} does not fit rows {self.filled}..{end - 1} "
                f"of a lease of {len(self.x)} samples shaped {tuple(self.x.shape[1:])}"
            )
        self.x[self.filled : end] = x
        self.y[self.filled : end] = y
        with self._arrived:
            self.filled = end
            self._arrived.notify_all()

    def fail(self, why: str) -> None:
        """The rest of the rows will not come (any thread): a compute waiting for them raises ``SamplesUnavailable``."""
        with self._arrived:
            self._error = why
            self._arrived.notify_all()

    def wait(self, rows: int, cancel: threading.Event | None = None) -> None:
        """Return once the first ``rows`` rows are there (the compute thread).

        Raises:
            SamplesUnavailable: they never will be.
            ComputeCancelled: ``cancel`` was set meanwhile.
        """
        rows = min(rows, len(self.x))
        started = time.perf_counter()
        with self._arrived:
            while self.filled < rows:
                if self._error is not None:
                    raise SamplesUnavailable(self._error)
                if cancel is not None and cancel.is_set():
                    raise ComputeCancelled("gradient computation abandoned")
                self._arrived.wait(timeout=0.1)
        self.waited_s += time.perf_counter() - started


@dataclass(frozen=True)
class GradientResult:
    """A lease's summed gradient (flat, on the CPU) and what the done report needs."""

    grad: torch.Tensor
    loss_sum: float
    num_samples: int
    compute_s: float  # the device's own time: a wait for a download inside the compute is not in it
    # Local leases only: the parameters the inner steps ended on (the estimate the next round starts
    # from while its base is being published), and the seconds spent waiting for that base.
    final_params: torch.Tensor | None = None
    rebase_wait_s: float = 0.0
    out_of_memory: int = 0  # out-of-memory errors this lease recovered from (each retried smaller)


def compute_gradient(
    cm: CampaignModel,
    x: torch.Tensor,
    y: torch.Tensor,
    microbatch_size: int,
    *,
    cancel: threading.Event | None = None,
    mixed_precision: bool = False,
    probe: MemoryProbe | None = None,
    arriving: ArrivingSamples | None = None,
) -> GradientResult:
    """Gradient of the summed per-sample loss over all samples, in microbatches.

    Summing (not averaging) lets aggregators add leases of any size and divide
    once by the step's sample count, and makes the result independent of the
    microbatch size. The memory wall is met on the device, never by losing the
    lease: an out-of-memory error switches on activation checkpointing (models
    that support it), then halves the microbatch, and the lease starts over;
    what the device learned holds for its later leases (``CampaignModel``).

    Args:
        cm: the campaign's model, holding the lease's base version.
        x: inputs, one row per sample.
        y: targets, one row per sample.
        microbatch_size: samples per forward/backward; bounds device memory.
        cancel: set from another thread to abandon the computation between microbatches.
        mixed_precision: the campaign allows autocast (used on CUDA only, see ``precision``).
        probe: measures the device's memory to size its microbatches (default: CUDA's allocator; none on a CPU).
        arriving: when ``x`` and ``y`` are its rows, still arriving: each microbatch waits for its own.

    Returns:
        The flat gradient in parameters_to_vector order, on the CPU.

    Raises:
        ComputeCancelled: if ``cancel`` was set.
        ValueError: for a non-positive microbatch size.
        torch.OutOfMemoryError: if not even one sample fits, with checkpointing on.
    """
    if microbatch_size < 1:
        raise ValueError(f"microbatch size must be at least 1, got {microbatch_size}")
    start = time.perf_counter()
    recovered = 0
    device = model_device(cm)
    dtype = autocast_dtype(device, mixed_precision)
    probe = probe if probe is not None else memory_probe(device)
    while True:
        size = min(microbatch_size, cm.microbatch_cap or microbatch_size)
        if dtype is torch.float16 and cm.fp16_failed:
            dtype = None
        try:
            grad, loss_sum = _summed_gradient(cm, x, y, size, cancel, dtype, probe, arriving)
        except FloatingPointError as exc:  # only fp16's loss scale raises it: the lease is computed in fp32
            cm.model.zero_grad(set_to_none=True)
            cm.fp16_failed = True
            logger.warning("%s; computing this campaign in fp32 on this device from now on", exc)
            continue
        except torch.OutOfMemoryError:
            cm.model.zero_grad(set_to_none=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            cm.out_of_memory += 1
            recovered += 1
            if not _smaller(cm, size):
                raise
            continue
        waited = arriving.waited_s if arriving is not None else 0.0
        return GradientResult(grad=grad, loss_sum=loss_sum, num_samples=len(x),
                              compute_s=time.perf_counter() - start - waited, out_of_memory=recovered)  # fmt: skip


def _smaller(cm: CampaignModel, size: int) -> bool:
    """After an out-of-memory error: checkpoint activations, else halve microbatches; False when neither is left."""
    enable = getattr(cm.model, "activation_checkpointing_enable", None)  # transformers' models have it
    if not cm.checkpointing and getattr(cm.model, "supports_gradient_checkpointing", False) and callable(enable):
        # Per block: activations are recomputed in the backward pass instead of kept (about a third more compute).
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
        cm.checkpointing = True
        logger.warning(
            "out of memory at microbatches of %s: activation checkpointing on, starting the lease over", size
        )
        return True
    if size > 1:
        cm.microbatch_cap = size // 2
        logger.warning("out of memory at microbatches of %s: %s from now on, starting the lease over", size, size // 2)
        return True
    return False


def _summed_gradient(
    cm: CampaignModel,
    x: torch.Tensor,
    y: torch.Tensor,
    microbatch_size: int,
    cancel: threading.Event | None,
    dtype: torch.dtype | None = None,
    probe: MemoryProbe | None = None,
    arriving: ArrivingSamples | None = None,
) -> tuple[torch.Tensor, float]:
    """The summed gradient, microbatch by microbatch, in autocast ``dtype`` if any (fp16 with a loss scale).

    With a ``probe``, the first microbatch a device computes for a campaign
    measures its peak memory, and later microbatches hold no more samples than
    ``precision.fitting_microbatch`` allows.
    """
    model, device = cm.model, model_device(cm)
    params = list(model.parameters())
    model.zero_grad(set_to_none=True)
    total = torch.zeros((), device=device)
    scale = cm.loss_scale if dtype is torch.float16 else None
    # fp16: each microbatch's gradient is checked for overflow before it joins the sum, so it gets its own.
    summed = torch.zeros(cm.param_count, device=device) if scale is not None else None
    # Otherwise the gradients accumulate straight into one flat vector (``_grads_into``): the lease's result,
    # with no second copy of the model's size made by concatenating them afterwards.
    flat_grad = _grads_into(params, cm.param_count, device) if scale is None else None
    size, lo = microbatch_size, 0
    while lo < len(x):
        if cancel is not None and cancel.is_set():
            raise ComputeCancelled("gradient computation abandoned")
        if arriving is not None:
            arriving.wait(lo + size, cancel)
        xb = x[lo : lo + size].to(device, non_blocking=True)
        yb = y[lo : lo + size].to(device, non_blocking=True)
        measuring = probe is not None and not cm.memory_measured
        if measuring:
            assert probe is not None
            # What stays whatever the microbatch: the model and (about to be allocated) its fp32 gradients.
            baseline = probe.allocated() + (0 if params[0].grad is not None else 4 * cm.param_count)
            probe.reset_peak()
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = cm.entry.loss_sum(model, xb, yb)
        if scale is None:
            loss.backward()  # accumulates into .grad across microbatches
        else:
            (loss.float() * scale.scale).backward()
            grad = _flat_grads(params)
            model.zero_grad(set_to_none=True)
            if not bool(torch.isfinite(grad).all()):
                scale.overflowed()
                logger.debug("fp16 gradient overflowed; loss scale now %s, computing the microbatch again", scale.scale)
                continue
            assert summed is not None
            summed.add_(grad, alpha=1.0 / scale.scale)
            scale.succeeded()
        total += loss.detach().float()  # stays on the device: no GPU->CPU sync per microbatch
        if measuring:
            assert probe is not None
            fit = fitting_microbatch(probe, baseline, probe.peak(), len(xb))
            cm.memory_measured = True
            if fit < size:
                cm.microbatch_cap = fit
                logger.warning(
                    "a microbatch of %s samples peaked at %.2f GiB of %.2f: %s per microbatch from now on",
                    len(xb), probe.peak() / 2**30, probe.capacity() / 2**30, fit,
                )  # fmt: skip
                size = fit
        lo += len(xb)
    # .cpu() and .item() are where the CPU waits for the GPU to finish the lease.
    if summed is not None:
        flat = summed
    elif flat_grad is not None and _still_views(params, flat_grad):
        flat = flat_grad
    else:  # something replaced a gradient tensor instead of adding into it: gather them as they are
        flat = _flat_grads(params)
    flat = flat.to("cpu", torch.float32)
    loss_sum = float(total.item())
    model.zero_grad(set_to_none=True)
    return flat, loss_sum


def _grads_into(params: list[nn.Parameter], count: int, device: torch.device) -> torch.Tensor:
    """A zeroed flat vector whose slices are the parameters' ``.grad``: backward adds into them in place."""
    flat = torch.zeros(count, dtype=torch.float32, device=device)
    at = 0
    for p in params:
        if p.dtype == torch.float32:
            p.grad = flat[at : at + p.numel()].view_as(p)
        at += p.numel()
    return flat


def _still_views(params: list[nn.Parameter], flat: torch.Tensor) -> bool:
    """Whether every gradient is still its slice of ``flat`` (autograd accumulates in place, as it should)."""
    start = flat.data_ptr()
    at = 0
    for p in params:
        grad = p.grad
        if grad is None or grad.data_ptr() != start + at * flat.element_size():
            return False
        at += p.numel()
    return True


def _flat_grads(params: list[nn.Parameter]) -> torch.Tensor:
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    return torch.cat([g.reshape(-1) for g in grads]).float()
