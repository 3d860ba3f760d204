"""CPU time from /proc: per process (user + system, all threads) and for the whole machine."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class CpuSample:
    at: float  # time.monotonic()
    ticks: dict[str, float]  # role -> clock ticks (user + system) summed over its processes
    machine_busy: float  # all cores, clock ticks


_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _process_ticks(pid: int) -> float:
    """utime + stime of a process (all its threads), in clock ticks; 0 once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    rest = text.rsplit(")", 1)[1].split()  # the name may hold spaces; fields after it are fixed
    return float(rest[11]) + float(rest[12])


def _service_pids() -> list[int]:
    """PostgreSQL and Redis processes on this machine (shared with others: reported for context only)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                comm = (entry / "comm").read_text().strip()
            except OSError:
                continue
            if comm in ("postgres", "redis-server"):
                pids.append(int(entry.name))
    return pids


def _machine_busy_ticks() -> float:
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    values = [float(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
    return sum(values) - values[3] - values[4]


def sample_cpu(roles: dict[str, list[int]]) -> CpuSample:
    ticks = {role: sum(_process_ticks(pid) for pid in pids) for role, pids in roles.items()}
    ticks["services"] = sum(_process_ticks(pid) for pid in _service_pids())
    return CpuSample(time.monotonic(), ticks, _machine_busy_ticks())


def cpu_between(a: CpuSample, b: CpuSample) -> tuple[dict[str, float], float]:
    """CPU seconds per role between two samples, and what other processes used, in cores."""
    seconds = {role: (b.ticks[role] - a.ticks.get(role, 0.0)) / _TICKS_PER_S for role in b.ticks}
    wall = max(b.at - a.at, 1e-9)
    foreign = (b.machine_busy - a.machine_busy) / _TICKS_PER_S - sum(seconds.values())
    return seconds, max(foreign, 0.0) / wall
