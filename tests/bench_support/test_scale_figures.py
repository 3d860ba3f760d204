"""The scale bench's lines: a phase that keeps up reads as such, and a phase that failed names every figure it owed."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

from tests.benchmarks.loadgen import reason_kind
from tests.benchmarks.scale import PhaseRun, cycle_figures, idle_figures, lost_leases, overload_figures


def _load(**overrides: Any) -> dict[str, Any]:
    load: dict[str, Any] = {
        "agents": 1000, "connected": 1000, "fatal": Counter(), "cycles": 20_000, "lease_ms": [5.0] * 99 + [80.0],
        "lease_unanswered": 0, "lease_outstanding": 0, "done_rejected": Counter(), "done_unconfirmed": 0,
        "loop_lag_max_ms": 3.0, "connect_ms": [10.0] * 1000, "reported": list(range(10)),
    }  # fmt: skip
    load.update(overrides)
    return load


def _run(load: dict[str, Any], *, site_cpu_s: float = 10.0, foreign: float = 0.0) -> PhaseRun:
    cpu_s = {"site": site_cpu_s, "worker": 3.0}
    return PhaseRun("wide-1000", 1000, 20.0, load, cpu_s, 20.0, foreign, period_s=1.0)


def test_a_phase_that_keeps_up_prints_its_rate_latency_and_cpu() -> None:
    lines = cycle_figures(_run(_load()), 1000, "")

    assert lines == [
        "bench: lease_cycles_per_s_1000=1000.0 (1000 agents offer 1000/s)",
        "bench: lease_p99_ms_1000=5.000",
        "bench: site_cpu_ms_per_lease_1000=0.500 (the Celery worker, which judges checks, used 0.150 ms more)",
        f"bench: serving_cpu_ms_per_cycle_1000=0.650 (= cores it takes per 1,000 cycles/s; this machine has "
        f"{os.cpu_count()}, load generator included)",
        "bench: done_rejected_1000=0",
        "bench: agents_not_connected_1000=0",
        "bench: step_publish_s_1000=skipped (no step was applied)",
        "bench: verification_per_cycle_1000=skipped (the phase's database was not read)",
    ]


def test_the_commit_pipeline_is_the_median_step_with_its_worst_and_its_size() -> None:
    run = _run(_load())
    run.step_publish = [(2000, 1.0), (2000, 3.0), (1998, 2.0)]

    line = cycle_figures(run, 1000, "")[-2]

    assert line.startswith("bench: step_publish_s_1000=2.000 (median of 3 steps of about 2000 leases, worst 3.00 s")


def test_verification_is_counted_per_cycle_of_the_window() -> None:
    run = _run(_load(cycles=1000))
    run.verification = (150, 120)

    line = cycle_figures(run, 1000, "")[-1]

    assert line.startswith(
        "bench: verification_per_cycle_1000=0.270 (150 checks opened and 120 copies reported over 1000"
    )


def test_a_busy_machine_makes_the_figures_lower_bounds() -> None:
    lines = cycle_figures(_run(_load(), foreign=0.8), 1000, "_w1like")

    assert lines[0].endswith("(1000 agents offer 1000/s; lower bound: other processes used 0.80 cores)")


def test_rejections_and_missing_agents_are_counted_with_their_reasons() -> None:
    load = _load(done_rejected=Counter({"lease expired": 7}), done_unconfirmed=2, connected=990,
                 fatal=Counter({"close code 4001": 4}))  # fmt: skip

    lines = cycle_figures(_run(load), 1000, "")

    assert lines[4] == "bench: done_rejected_1000=9 (lease expired: 7, no answer: 2)"
    assert lines[5] == "bench: agents_not_connected_1000=10 (4 stopped on close code 4001)"


def test_a_failed_phase_prints_every_figure_as_skipped() -> None:
    assert cycle_figures("the site did not start", 100, "") == [
        f"bench: {name}_100=skipped (the site did not start)"
        for name in ("lease_cycles_per_s", "lease_p99_ms", "site_cpu_ms_per_lease", "serving_cpu_ms_per_cycle",
                     "done_rejected", "agents_not_connected", "step_publish_s", "verification_per_cycle")
    ]  # fmt: skip
    assert all("=skipped (timed out)" in line for line in idle_figures("timed out", 10_000, 200.0))
    assert all("=skipped (timed out)" in line for line in overload_figures("timed out", 5000, [0]))


def test_agents_that_never_connected_count_as_infinite_connect_time() -> None:
    load = _load(connected=980, connect_ms=[10.0] * 980)

    lines = idle_figures(_run(load, site_cpu_s=4.0), 1000, 200.0)

    assert lines[0] == "bench: idle_cpu_pct_per_1000=20.408 (980 agents connected)"
    assert lines[1].startswith("bench: connect_p99_ms_1000=inf (joining at 200/s; 20 never connected")


def test_a_backup_twin_that_lost_the_race_is_not_lost_work_but_every_other_uncounted_report_is() -> None:
    states = {
        1: "accepted",
        2: "released: the backup lease finished first",
        3: "released: the original lease finished first",
        4: "expired: agent went silent",
        5: "released: released by the agent",
        6: "rejected: stale version: computed on 3, step 5 is open",
    }

    assert lost_leases([1, 2, 3, 4, 5, 6, 7], states) == [4, 5, 6, 7]  # 7: no row at all


def test_rejection_reasons_keep_their_words_and_lose_their_numbers() -> None:
    assert reason_kind("lease released: the original lease finished first") == (
        "lease released: the original lease finished first"
    )
    assert reason_kind("stale version: computed on 3, step 5 is open") == "stale version"
    assert reason_kind("") == "no reason"
