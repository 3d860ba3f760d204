"""The agent's CUDA path: what a GPU computes is what the CPU computes, and the hello says which GPU it was.

Skipped where PyTorch sees no CUDA device (tests/conftest.py); run on a GPU
machine with ``pytest tests/agent/test_cuda.py``. TF32 stays off, as PyTorch
leaves it by default for float32 matrix products, so the comparison is float32
against float32 and differs only by the order of the sums.
"""

from __future__ import annotations

import pytest
import torch

from crowdtrain_agent.device import describe_device, select_device
from crowdtrain_agent.local_steps import build_inner_optimizer, compute_pseudo_gradient
from crowdtrain_agent.models import get_model
from crowdtrain_agent.protocol import ModelSpec, OptimizerSpec
from crowdtrain_agent.trainer import CampaignModel, ModelCache, compute_gradient, load_params_

pytestmark = pytest.mark.gpu

CASES = {
    "gpt": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16},
    "mlp": {"in_dim": 32, "hidden": [64, 64], "classes": 5},
}


def _batch(arch: str, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if arch == "gpt":
        tokens = torch.randint(0, 256, (n, CASES["gpt"]["block_size"] + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    return torch.randn(n, CASES["mlp"]["in_dim"], generator=g), torch.randint(0, 5, (n,), generator=g)


def _models(arch: str) -> tuple[CampaignModel, CampaignModel, torch.Tensor]:
    """The same campaign model, holding the same parameters, on the CPU and on the GPU."""
    spec = ModelSpec(architecture=arch, config=CASES[arch])
    params = torch.nn.utils.parameters_to_vector(get_model(arch).build(CASES[arch], seed=3).parameters()).detach()
    on_cpu = ModelCache(torch.device("cpu")).get(1, spec)
    on_gpu = ModelCache(torch.device("cuda")).get(1, spec)
    # Copies: on the CPU, loading makes the parameters views of the flat vector they came from.
    load_params_(on_cpu, params.clone(), version=5)
    load_params_(on_gpu, params.clone(), version=5)
    return on_cpu, on_gpu, params


@pytest.mark.parametrize("arch", sorted(CASES))
def test_a_lease_gradient_on_the_gpu_is_the_cpu_gradient(arch: str) -> None:
    on_cpu, on_gpu, _ = _models(arch)
    x, y = _batch(arch, 37, seed=1)

    cpu = compute_gradient(on_cpu, x, y, microbatch_size=8)
    gpu = compute_gradient(on_gpu, x, y, microbatch_size=8)

    assert gpu.grad.device.type == "cpu" and gpu.grad.dtype == torch.float32, "uploads are CPU float32"
    assert next(on_gpu.model.parameters()).device.type == "cuda"
    torch.testing.assert_close(gpu.grad, cpu.grad, rtol=1e-4, atol=1e-5)
    assert gpu.loss_sum == pytest.approx(cpu.loss_sum, rel=1e-5)
    assert gpu.num_samples == 37 and gpu.compute_s > 0


@pytest.mark.parametrize("arch", sorted(CASES))
def test_local_steps_on_the_gpu_move_the_model_as_on_the_cpu(arch: str) -> None:
    on_cpu, on_gpu, params = _models(arch)
    x, y = _batch(arch, 24, seed=2)
    inner = OptimizerSpec(name="adamw", lr=1e-3, weight_decay=0.01)

    results = [
        compute_pseudo_gradient(cm, build_inner_optimizer(cm.model, inner), inner.lr, x, y, 4, inner_batch_size=8)
        for cm in (on_cpu, on_gpu)
    ]

    # AdamW divides by the root of each gradient's running square: where a gradient is near zero, the
    # devices' different rounding moves a parameter by up to lr per step either way. The whole movement
    # still agrees closely, as its norm says.
    gpu, cpu = results[1].grad, results[0].grad
    error = float(torch.linalg.vector_norm(gpu - cpu) / torch.linalg.vector_norm(cpu))
    assert error < 1e-2, f"relative difference {error:.3g} between the GPU's and the CPU's pseudo-gradients"
    back = torch.nn.utils.parameters_to_vector(on_gpu.model.parameters()).detach().cpu()
    assert torch.equal(back, params), "the GPU model is back on its base parameters"


def test_the_hello_describes_the_gpu_it_will_compute_on() -> None:
    device = select_device("auto")
    info = describe_device(device, benchmark_s=0.2)

    props = torch.cuda.get_device_properties(device)
    assert device.type == "cuda"
    assert (info.kind, info.name, info.memory_bytes) == ("cuda", props.name, props.total_memory)
    # Any CUDA GPU multiplies float32 matrices faster than 100 GFLOP/s; a CPU-sized figure means a CPU timing.
    assert info.flops_per_s > 1e11, f"measured {info.flops_per_s / 1e9:.1f} GFLOP/s"
