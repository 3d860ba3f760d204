"""Local-steps leases (DiLoCo): inner optimizer steps on the agent's copy of the model, and their pseudo-gradient.

A ``local`` lease is H inner steps from the lease's base version, one per
``inner_batch_size`` of its samples (the gradients of that many samples'
microbatches added up, as one big machine would with gradient accumulation):
the campaign's inner batch is an optimization setting, the microbatch only
what fits in a volunteer's memory. What goes up is the pseudo-gradient, the base
parameters minus the final ones, times the lease's sample count: aggregators
add uploads and divide by the round's samples as they do with summed
gradients, so a round averages its pseudo-gradients weighted by samples and
the outer optimizer steps on that. H follows the lease's size, which the site
already fits to the device's speed, so a slow and a fast device both finish a
lease in about the lease target time.

Overlapped rounds (staleness 1, ``Lease.rebase_to``): the site leases the
next round while the last one is still being uploaded and published. Waiting
for that publication would leave the device idle for an upload and a download
every round (1.7 s of every 7.5 on a home link), so the agent starts the new
lease from its own estimate of the round's base, the parameters its last lease
of the round before ended on, and when the exact version arrives it moves its
parameters by the difference, between two inner steps: from then on it trains
exactly where the round began, and what it uploads is its movement from there.
With one agent and an outer SGD of lr 1 without momentum the estimate is the
version itself, so nothing moves and the run equals plain PyTorch; with more
agents or an outer momentum, only the inner steps taken before the version
arrived were taken at a nearby point (the eager outer step of Kale et al.,
2025, with the agent's own pseudo-gradient standing in for the round's).

The inner optimizer's state (AdamW's moments) stays with the agent between
leases of the same campaign, as each DiLoCo worker keeps its own; it is
dropped, with a log line saying why, when the next lease's base version is too
far ahead of the last one trained on (the moments describe a model the
campaign has long left) or behind it (a rollback).

Only optimizers torch builds itself run here (``INNER_OPTIMIZERS``): the lease
names one and its hyperparameters, never code.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .optimizers import INNER_OPTIMIZERS, hyperparameters_of
from .precision import autocast_dtype
from .protocol import Lease, OptimizerSpec
from .torch_optimizers import ELEMENTWISE, decays, torch_optimizer
from .trainer import CampaignModel, ComputeCancelled, GradientResult

logger = logging.getLogger(__name__)

# Outer steps the campaign may make between two leases of this agent before its inner state is dropped:
# past this, the moments were gathered on parameters far from the ones the next lease starts from.
MAX_STATE_LAG = 16


class InnerOptimizerError(ValueError):
    """A lease names an inner optimizer this agent does not run; the lease is given back."""


class RebaseFailed(RuntimeError):
    """The version an overlapped lease must rebase onto did not come in time; the lease is given back."""


class RoundBase:
    """The exact parameters of an overlapped lease's round base, handed from a download thread to the compute.

    The download starts when the lease arrives and long-polls the aggregators
    (they answer a version the moment it is published); the compute thread
    looks between inner steps and takes it as soon as it is there.
    """

    def __init__(self, version: int) -> None:
        self.version = version
        self._ready = threading.Event()
        self._flat: torch.Tensor | None = None
        self._error = ""

    def deliver(self, flat: torch.Tensor) -> None:
        """Hand over the verified parameters of ``version``."""
        if not self._ready.is_set():
            self._flat = flat
            self._ready.set()

    def fail(self, why: str) -> None:
        """Say the parameters will not come, and why (nothing, once they came or failed)."""
        if not self._ready.is_set():
            self._error = why or "the download failed"
            self._ready.set()

    def poll(self) -> torch.Tensor | None:
        """The parameters if they have come, None if not yet.

        Raises:
            RebaseFailed: if the download failed.
        """
        if not self._ready.is_set():
            return None
        if self._flat is None:
            raise RebaseFailed(f"the parameters of version {self.version} to rebase onto are missing: {self._error}")
        return self._flat

    def wait(self, timeout_s: float, cancel: threading.Event | None = None) -> torch.Tensor:
        """The parameters, waiting up to ``timeout_s`` for them.

        Raises:
            RebaseFailed: if they fail or do not come in time.
            ComputeCancelled: if ``cancel`` is set meanwhile.
        """
        deadline = time.monotonic() + max(0.0, timeout_s)
        while not self._ready.wait(min(0.05, max(0.0, deadline - time.monotonic()))):
            if cancel is not None and cancel.is_set():
                raise ComputeCancelled("local steps abandoned while waiting for the round's base version")
            if time.monotonic() >= deadline:
                raise RebaseFailed(
                    f"version {self.version}, the base of this lease's round, was not published within "
                    f"{timeout_s:.0f} s (its last lease may have been lost)"
                )
        flat = self.poll()
        assert flat is not None  # ready, and poll raises when it failed
        return flat


@dataclass
class _Inner:
    optimizer: torch.optim.Optimizer
    model: torch.nn.Module
    spec: OptimizerSpec
    version: int  # the base version of the last lease trained with it
    # Round base -> the parameters this agent's last lease moving from it ended on: its estimate of the
    # next round's base, where an overlapped lease of that round starts. The newest two rounds are kept.
    ends: dict[int, torch.Tensor] = field(default_factory=dict)


def local_lease_problem(lease: Lease) -> str:
    """Why this agent cannot work a lease's mode ("" when it can): checked before anything is downloaded."""
    if lease.mode != "local":
        if lease.rebase_to is not None:
            return "a sync lease that says to rebase, which only local-steps leases do; the site is misconfigured"
        return ""
    if lease.inner is None:
        return "a local-steps lease without an inner optimizer; the site is misconfigured"
    if lease.inner.name not in INNER_OPTIMIZERS:
        return (
            f"its inner optimizer {lease.inner.name!r} is not one this agent runs ({', '.join(INNER_OPTIMIZERS)}); "
            "upgrade crowdtrain-agent (pip install -U crowdtrain-agent)"
        )
    if lease.rebase_to is not None and lease.rebase_to <= lease.base_version:
        return (
            f"it says to rebase onto version {lease.rebase_to}, which is not newer than its base version "
            f"{lease.base_version}; the site is misconfigured"
        )
    inner_batch, micro = lease.inner_batch_size, lease.microbatch_size
    if inner_batch is not None and (micro < 1 or not inner_batch or inner_batch % micro):
        return (
            f"its inner batch of {inner_batch} samples is not a positive multiple of its microbatch of "
            f"{lease.microbatch_size}; the site is misconfigured"
        )
    return ""


def _same_settings(a: OptimizerSpec, b: OptimizerSpec) -> bool:
    """Whether two specs build the same optimizer; the learning rate is set per lease (the schedule moves it)."""
    fields = ("name", "beta1", "beta2", "eps", "weight_decay", "momentum", "nesterov", "decay_all")
    return all(getattr(a, f) == getattr(b, f) for f in fields)


def _fastest(build: Callable[..., torch.optim.Optimizer]) -> torch.optim.Optimizer:
    """The optimizer on torch's fused kernels where the device has them, else its default loop.

    An inner step updates every parameter, and local leases take hundreds of
    them: on the CPU the per-tensor loop torch uses by default costs about as
    much as a microbatch's forward and backward pass, the fused kernel a tenth
    of that (docs/performance.md, "Fused optimizers"). The arithmetic is the
    same update; only the order of rounding differs.
    """
    try:
        return build(fused=True)
    except (RuntimeError, ValueError):  # a device or dtype without fused kernels
        return build()


def build_inner_optimizer(model: torch.nn.Module, spec: OptimizerSpec) -> torch.optim.Optimizer:
    """The torch optimizer of ``spec`` over ``model``'s parameters, built as the aggregators build theirs.

    Weight decay goes to the tensors ``torch_optimizers.decays`` names, as the aggregators apply it in
    sync mode; here as a param group of its own, since an agent holds whole tensors.

    Raises:
        InnerOptimizerError: for an optimizer other than ``INNER_OPTIMIZERS``.
    """
    if spec.name not in ELEMENTWISE:
        raise InnerOptimizerError(
            f"the lease's inner optimizer {spec.name!r} is not one this agent runs ({', '.join(INNER_OPTIMIZERS)}); "
            "upgrade crowdtrain-agent (pip install -U crowdtrain-agent)"
        )
    hyper = hyperparameters_of(spec)
    params = list(model.parameters())
    decayed = [p for p in params if decays(p.dim(), decay_all=hyper["decay_all"])]
    plain = [p for p in params if not decays(p.dim(), decay_all=hyper["decay_all"])]
    groups = [
        group
        for group in (
            {"params": decayed, "weight_decay": hyper["weight_decay"]},
            {"params": plain, "weight_decay": 0.0},
        )
        if group["params"]
    ]
    return _fastest(lambda **path: torch_optimizer(spec.name, groups, hyper, **path))


class InnerOptimizers:
    """Each campaign's inner optimizer, kept between its leases (only the compute thread touches them)."""

    def __init__(self, max_lag: int = MAX_STATE_LAG) -> None:
        self.max_lag = max_lag
        self._by_campaign: dict[int, _Inner] = {}

    def get(self, campaign_id: int, cm: CampaignModel, spec: OptimizerSpec, base_version: int) -> torch.optim.Optimizer:
        """The campaign's inner optimizer for a lease on ``base_version``, fresh when the old one cannot serve.

        Raises:
            InnerOptimizerError: for an optimizer this agent does not run.
        """
        held = self._by_campaign.get(campaign_id)
        why = ""
        if held is not None:
            if held.model is not cm.model or not _same_settings(held.spec, spec):
                why = "the campaign's model or inner optimizer changed"
            elif base_version < held.version:
                why = f"the campaign went back to version {base_version} from {held.version} (a rollback)"
            elif base_version - held.version > self.max_lag:
                why = (
                    f"this agent last trained on version {held.version} and the lease starts from {base_version}, "
                    f"more than {self.max_lag} steps on, so its moments describe a model the campaign has left"
                )
        if held is None or why:
            if why:
                logger.info("campaign %d: starting the inner optimizer afresh: %s", campaign_id, why)
            held = _Inner(build_inner_optimizer(cm.model, spec), cm.model, spec, base_version)
            self._by_campaign[campaign_id] = held
        held.version = base_version
        return held.optimizer

    def estimate(self, campaign_id: int, round_base: int) -> torch.Tensor | None:
        """Where a lease of the round stepping from ``round_base`` starts before that version is published.

        The parameters this agent's last lease of the round before ended on;
        None when it worked none (then the lease starts from its base version).
        """
        held = self._by_campaign.get(campaign_id)
        return None if held is None else held.ends.get(round_base - 1)

    def remember(self, campaign_id: int, round_base: int, final: torch.Tensor | None) -> None:
        """Keep the parameters a lease moving from ``round_base`` ended on (``estimate`` gives them back)."""
        held = self._by_campaign.get(campaign_id)
        if held is None or final is None:
            return
        held.ends[round_base] = final
        for old in [r for r in held.ends if r < max(held.ends) - 1]:
            del held.ends[old]

    def drop(self, campaign_id: int) -> None:
        self._by_campaign.pop(campaign_id, None)


def compute_pseudo_gradient(
    cm: CampaignModel,
    optimizer: torch.optim.Optimizer,
    lr: float,
    x: torch.Tensor,
    y: torch.Tensor,
    microbatch_size: int,
    *,
    inner_batch_size: int | None = None,
    cancel: threading.Event | None = None,
    start: torch.Tensor | None = None,
    rebase: RoundBase | None = None,
    rebase_wait_s: float = 60.0,
    mixed_precision: bool = False,
) -> GradientResult:
    """Run inner steps from the model's current (base) parameters; return the pseudo-gradient.

    With ``mixed_precision`` a CUDA device with bf16 computes in bf16 autocast; fp16's loss scale would
    have to skip inner steps that overflow, so a GPU without bf16 takes its inner steps in fp32.

    Each inner step follows the mean loss of ``inner_batch_size`` samples, taken
    as microbatches whose gradients add up, so the step is the one a machine
    holding the whole inner batch at once would take. An inner step costs an
    optimizer update of every parameter: on small microbatches (AdamW on W1's
    64 samples) that update took almost as long as the forward and backward
    pass, and a larger inner batch makes it rare.

    The model is put back on its base parameters afterwards, also when the
    work is cancelled, so the parameter version the model cache says it holds
    stays true and the next lease on that version downloads nothing.

    Args:
        cm: the campaign's model, holding the lease's base version.
        optimizer: the campaign's inner optimizer over ``cm.model`` (``InnerOptimizers.get``).
        lr: the inner learning rate of this lease (the site applies the campaign's schedule).
        x: inputs, one row per sample.
        y: targets, one row per sample.
        microbatch_size: samples per forward and backward pass.
        inner_batch_size: samples per inner step, a multiple of ``microbatch_size``; None: one microbatch.
            The last inner step takes the samples left when ``len(x)`` is not a multiple.
        cancel: set from another thread to abandon the lease between inner steps.
        start: flat parameters to begin the inner steps from instead of the model's (an overlapped lease's
            estimate of its round base, ``InnerOptimizers.estimate``).
        rebase: an overlapped lease's round base: once its parameters are there (looked for before each
            inner step, waited for after the last), the parameters move by (round base - where the steps
            began), and the pseudo-gradient is the movement from the round base.
        rebase_wait_s: how long to wait after the last inner step for ``rebase``'s parameters.

    Returns:
        ``grad`` = (round base - final parameters) * number of samples, flat, fp32, on the CPU, where the
        round base is the model's base version unless ``rebase`` names another; ``loss_sum`` the summed
        per-sample loss met along the way (each microbatch's before its step); ``final_params`` where the
        steps ended, on the model's device; ``rebase_wait_s`` the seconds waited for ``rebase`` after the
        last step, which ``compute_s`` leaves out.

    Raises:
        ComputeCancelled: if ``cancel`` was set.
        RebaseFailed: if ``rebase``'s parameters failed or did not come within ``rebase_wait_s``.
        ValueError: for a non-positive microbatch size, an inner batch that is not a multiple of it, or no samples.
    """
    if microbatch_size < 1:
        raise ValueError(f"microbatch size must be at least 1, got {microbatch_size}")
    inner_batch = microbatch_size if inner_batch_size is None else inner_batch_size
    if inner_batch < 1 or inner_batch % microbatch_size:
        raise ValueError(f"inner batch {inner_batch} is not a positive multiple of the microbatch {microbatch_size}")
    if len(x) == 0:
        raise ValueError("a local lease needs at least one sample")
    model = cm.model
    device = next(model.parameters()).device
    params = list(model.parameters())
    started = time.perf_counter()
    bf16 = autocast_dtype(device, mixed_precision) is torch.bfloat16
    base = torch.nn.utils.parameters_to_vector(params).detach().clone()
    for group in optimizer.param_groups:
        group["lr"] = lr
    total = torch.zeros((), device=device)
    # Where the steps began: the round base, or the estimate of it until the exact one arrives.
    origin = base
    waited = 0.0

    def move_onto(exact: torch.Tensor) -> torch.Tensor:
        exact = exact.to(device, torch.float32)
        with torch.no_grad():
            here = torch.nn.utils.parameters_to_vector(params)
            torch.nn.utils.vector_to_parameters(here + (exact - origin), params)
        return exact

    try:
        if start is not None:
            if start.numel() != base.numel():
                raise ValueError(f"a start of {start.numel()} parameters for a model of {base.numel()}")
            origin = start.to(device, torch.float32)
            with torch.no_grad():  # a copy: the steps change the parameters in place
                torch.nn.utils.vector_to_parameters(origin.clone(), params)
        for first in range(0, len(x), inner_batch):
            if rebase is not None and (exact := rebase.poll()) is not None:
                origin, rebase = move_onto(exact), None
            step_samples = min(inner_batch, len(x) - first)
            optimizer.zero_grad(set_to_none=True)
            for lo in range(first, first + step_samples, microbatch_size):
                if cancel is not None and cancel.is_set():
                    raise ComputeCancelled("local steps abandoned")
                hi = min(lo + microbatch_size, first + step_samples)
                xb = x[lo:hi].to(device, non_blocking=True)
                yb = y[lo:hi].to(device, non_blocking=True)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                    loss_sum = cm.entry.loss_sum(model, xb, yb)
                (loss_sum / step_samples).backward()  # adds up to the inner batch's mean loss
                total += loss_sum.detach().float()
            optimizer.step()
        if rebase is not None:
            waiting_from = time.perf_counter()
            origin = move_onto(rebase.wait(rebase_wait_s, cancel))
            waited = time.perf_counter() - waiting_from
        final = torch.nn.utils.parameters_to_vector(params).detach()
        pseudo = (origin - final).to("cpu", torch.float32) * float(len(x))
        loss_sum_value = float(total.item())
    finally:
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(base, params)
        optimizer.zero_grad(set_to_none=True)
    return GradientResult(
        grad=pseudo,
        loss_sum=loss_sum_value,
        num_samples=len(x),
        compute_s=time.perf_counter() - started - waited,
        final_params=final,
        rebase_wait_s=waited,
    )
