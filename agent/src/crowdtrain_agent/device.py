"""Which device the agent computes on, and what it tells the site about it."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

from .config import ConfigError
from .protocol import DeviceInfo

logger = logging.getLogger(__name__)


def _mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def select_device(
    requested: str,
    *,
    cuda_available: Callable[[], bool] = torch.cuda.is_available,
    mps_available: Callable[[], bool] = _mps_available,
) -> torch.device:
    """Turn ``--device`` into a torch device; ``auto`` prefers CUDA, then Apple MPS, then the CPU.

    Args:
        requested: auto, cpu, cuda or mps.
        cuda_available: probe for CUDA (replaceable in tests).
        mps_available: probe for Apple's Metal backend (replaceable in tests).

    Raises:
        ConfigError: if a device was asked for by name and this machine lacks it.
    """
    if requested == "auto":
        if cuda_available():
            return torch.device("cuda")
        if mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    if requested == "cuda" and not cuda_available():
        raise ConfigError(
            "--device cuda was asked for but PyTorch sees no CUDA GPU; install a CUDA build of torch "
            "and check the driver (nvidia-smi), or use --device auto"
        )
    if requested == "mps" and not mps_available():
        raise ConfigError("--device mps was asked for but Apple's Metal backend is not available; use --device auto")
    if requested not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"--device must be one of auto, cpu, cuda, mps, got {requested!r}")
    return torch.device(requested)


def measure_flops(device: torch.device, budget_s: float = 0.2) -> float:
    """Rough float32 matmul throughput in FLOP/s, measured for at most about ``budget_s``.

    The site uses it only to size the first lease before real samples/s are
    known, so a short and noisy measurement is good enough.
    """
    n = 1024 if device.type != "cpu" else 256
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    torch.matmul(a, b)  # warm-up: kernel selection, allocator
    _sync(device)
    runs = 0
    start = time.perf_counter()
    while True:
        torch.matmul(a, b)
        runs += 1
        if runs % 4 == 0:
            _sync(device)  # the GPU runs ahead of the CPU; time only finished work
            elapsed = time.perf_counter() - start
            if elapsed >= budget_s / 2:
                return 2.0 * n**3 * runs / elapsed


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def describe_device(device: torch.device, *, benchmark_s: float = 0.2) -> DeviceInfo:
    """What the agent reports in its hello: device kind, name, memory, threads, measured speed."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name, memory = props.name, int(props.total_memory)
    elif device.type == "mps":
        name, memory = "Apple GPU (MPS)", 0
    else:
        name, memory = _cpu_name(), _system_memory()
    flops = measure_flops(device, benchmark_s)
    logger.debug("device %s (%s): %.1f GFLOP/s", device, name, flops / 1e9)
    return DeviceInfo(
        kind=device.type,  # type: ignore[arg-type]  # select_device returns only cpu, cuda, mps
        name=name,
        memory_bytes=memory,
        threads=torch.get_num_threads(),
        torch_version=str(torch.__version__),  # a str subclass the encoder does not know
        flops_per_s=flops,
    )


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    machine = os.uname().machine if hasattr(os, "uname") else ""
    return f"{machine} cpu".strip()


def _system_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def cap_gpu_memory(device: torch.device, gigabytes: float) -> None:
    """Keep this process within ``gigabytes`` of a CUDA device's memory (the volunteer's ``--gpu-memory-gb``).

    PyTorch's allocator raises out-of-memory past the cap, which the trainer meets like any memory wall
    (checkpointing, then smaller microbatches). Other devices have no such cap: it is logged and ignored.
    """
    if device.type != "cuda":
        logger.warning("--gpu-memory-gb applies to CUDA GPUs only; this agent computes on %s", device)
        return
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, gigabytes * (1 << 30) / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    logger.info("using at most %.1f GB of the GPU's %.1f GB", fraction * total / (1 << 30), total / (1 << 30))
