"""The volunteer's memory wall: autocast gradients stay within a stated tolerance of fp32, fp16's loss scale
recovers from overflow, and the first microbatch's measured peak sizes the next ones.

Tolerance (a Llama of 2 layers, 8 samples): cosine similarity to the fp32 gradient at least 0.999 and
relative L2 error at most 3% in bf16 (8 bits of mantissa), 0.5% in fp16 (11 bits). Verification copies
agree at a cosine of 0.99, so a GPU in autocast and a CPU in fp32 still verify each other.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest
import torch

from crowdtrain_agent.precision import MEMORY_FRACTION, LossScale, autocast_dtype
from crowdtrain_agent.protocol import DataSpec, Lease, ModelSpec
from crowdtrain_agent.protocol.schema import lost_in
from crowdtrain_agent.trainer import _summed_gradient, compute_gradient
from tests.agent.test_the_memory_wall_costs_no_lease import _model, _tokens


def _close_to(grad: torch.Tensor, reference: torch.Tensor, relative: float) -> None:
    cosine = float(torch.nn.functional.cosine_similarity(grad, reference, dim=0))
    error = float(torch.linalg.vector_norm(grad - reference) / torch.linalg.vector_norm(reference))
    assert cosine >= 0.999, f"cosine {cosine:.5f}"
    assert error <= relative, f"relative error {error:.4f}"


def test_bf16_autocast_on_a_cpu_gives_the_fp32_gradient_within_tolerance() -> None:
    x, y = _tokens()
    reference, loss = _summed_gradient(_model(), x, y, 4, None)

    grad, bf16_loss = _summed_gradient(_model(), x, y, 4, None, torch.bfloat16)

    _close_to(grad, reference, 0.03)
    assert grad.dtype == torch.float32 and abs(bf16_loss - loss) / loss < 0.01


def test_fp16_with_a_loss_scale_gives_the_fp32_gradient_and_recovers_from_overflow() -> None:
    x, y = _tokens()
    reference, _ = _summed_gradient(_model(), x, y, 4, None)
    cm = _model()
    cm.loss_scale = LossScale(2.0**40)  # far past fp16's range: the first tries overflow

    grad, _ = _summed_gradient(cm, x, y, 4, None, torch.float16)

    _close_to(grad, reference, 0.005)
    assert cm.loss_scale.overflows > 0 and cm.loss_scale.scale < 2.0**40


def test_a_loss_that_overflows_even_unscaled_is_an_error_not_a_silent_nan() -> None:
    scale = LossScale(1.0)

    with pytest.raises(FloatingPointError, match="turn mixed precision off"):
        scale.overflowed()


def test_a_device_whose_fp16_overflows_even_unscaled_computes_the_lease_in_fp32(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from crowdtrain_agent import trainer

    x, y = _tokens()
    reference, _ = _summed_gradient(_model(), x, y, 4, None)
    cm = _model()
    monkeypatch.setattr(trainer, "autocast_dtype", lambda device, allowed: torch.float16)  # a GPU without bf16
    loss_sum = cm.entry.loss_sum

    def overflowing(model: torch.nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        loss = loss_sum(model, xb, yb)
        return loss * float("inf") if torch.is_autocast_enabled("cpu") else loss

    cm.entry = dataclasses.replace(cm.entry, _loss_sum=overflowing)

    result = compute_gradient(cm, x, y, microbatch_size=4, mixed_precision=True)

    assert cm.fp16_failed and cm.loss_scale.scale == 1.0
    torch.testing.assert_close(result.grad, reference, rtol=1e-5, atol=1e-6)


def test_a_cpu_computes_in_fp32_whatever_the_campaign_allows() -> None:
    assert autocast_dtype(torch.device("cpu"), True) is None
    assert autocast_dtype(torch.device("cuda"), False) is None


@dataclass
class FakeGpu:
    """A device of ``capacity`` bytes whose activations cost ``per_sample`` bytes each (no GPU here)."""

    capacity_bytes: int
    per_sample: int
    held: int = 1 << 20
    running: list[int] = field(default_factory=list)

    def capacity(self) -> int:
        return self.capacity_bytes

    def reset_peak(self) -> None:
        self.running.clear()

    def allocated(self) -> int:
        return self.held

    def peak(self) -> int:
        return self.held + self.running[-1]


def test_the_first_microbatch_measures_the_device_and_sizes_the_rest() -> None:
    x, y = _tokens(16)
    expected = compute_gradient(_model(), x, y, microbatch_size=16)
    cm = _model()
    gpu = FakeGpu(capacity_bytes=100 << 20, per_sample=25 << 20)
    sizes: list[int] = []
    loss_sum = cm.entry.loss_sum

    def costed(model: torch.nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        sizes.append(len(xb))
        gpu.running.append(gpu.per_sample * len(xb) + 4 * cm.param_count)  # activations and the new gradients
        return loss_sum(model, xb, yb)

    cm.entry = dataclasses.replace(cm.entry, _loss_sum=costed)

    result = compute_gradient(cm, x, y, microbatch_size=8, probe=gpu)

    fits = int(((100 << 20) * MEMORY_FRACTION - (1 << 20) - 4 * cm.param_count) // (25 << 20))
    assert fits == 3 and cm.microbatch_cap == fits and cm.memory_measured
    assert sizes == [8, 3, 3, 2]  # measured on the first, sized from the second on
    torch.testing.assert_close(result.grad, expected.grad, rtol=1e-5, atol=1e-6)
    compute_gradient(cm, x, y, microbatch_size=8, probe=gpu)
    assert sizes[4:] == [3, 3, 3, 3, 3, 1]  # the next lease starts at the measured size


def test_the_campaign_switch_travels_in_the_lease_and_an_older_agent_just_computes_in_fp32() -> None:
    lease = Lease(
        lease_id=1, campaign_id=1, base_version=0, ranges=[], num_samples=1, microbatch_size=1, deadline_s=60.0,
        ticket="t", codec="fp32", model=ModelSpec(architecture="mlp", config={}), data=DataSpec(kind="tensors"),
        param_count=1, slices=[], mixed_precision=True,
    )  # fmt: skip

    assert lost_in(lease, 5) == []  # advisory: nothing an older agent must be refused for


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; this machine has none")
def test_on_cuda_autocast_gives_the_fp32_gradient_within_tolerance() -> None:
    x, y = _tokens()
    reference, _ = _summed_gradient(_model(), x, y, 4, None)
    cm = _model()
    cm.model.to("cuda")

    result = compute_gradient(cm, x, y, microbatch_size=4, mixed_precision=True)

    dtype = autocast_dtype(torch.device("cuda"), True)
    _close_to(result.grad, reference, 0.03 if dtype is torch.bfloat16 else 0.005)
    assert result.grad.device.type == "cpu" and result.grad.dtype == torch.float32


def test_gradients_accumulate_into_the_leases_flat_vector_without_a_second_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from crowdtrain_agent import trainer

    x, y = _tokens()
    expected = compute_gradient(_model(), x, y, microbatch_size=4).grad

    def concatenated(params: object) -> torch.Tensor:
        raise AssertionError("the gradients were gathered into a second vector")

    monkeypatch.setattr(trainer, "_flat_grads", concatenated)
    cm = _model()
    result = compute_gradient(cm, x, y, microbatch_size=4)

    torch.testing.assert_close(result.grad, expected, rtol=0, atol=0)
    assert all(p.grad is None for p in cm.model.parameters())  # the vector is the lease's now, not the model's
