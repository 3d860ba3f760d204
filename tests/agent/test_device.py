"""Device selection and the start-up benchmark."""

from __future__ import annotations

import pytest
import torch

from crowdtrain_agent.config import ConfigError
from crowdtrain_agent.device import describe_device, select_device


def test_auto_prefers_cuda_then_mps_then_falls_back_to_cpu() -> None:
    assert select_device("auto", cuda_available=lambda: True, mps_available=lambda: True).type == "cuda"
    assert select_device("auto", cuda_available=lambda: False, mps_available=lambda: True).type == "mps"
    assert select_device("auto", cuda_available=lambda: False, mps_available=lambda: False).type == "cpu"


def test_asking_for_a_missing_gpu_stops_with_a_hint() -> None:
    with pytest.raises(ConfigError, match="use --device auto"):
        select_device("cuda", cuda_available=lambda: False)


def test_cpu_description_includes_a_measured_speed() -> None:
    info = describe_device(torch.device("cpu"), benchmark_s=0.02)

    assert info.kind == "cpu" and info.flops_per_s > 0 and info.threads >= 1 and info.torch_version == torch.__version__
