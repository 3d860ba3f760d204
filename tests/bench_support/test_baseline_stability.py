"""The baseline-stability rule: a phase runs between two baselines, again while they disagree, else ``unstable``."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from tests.benchmarks.figures import BaselinePair, between_baselines, ratio_or_unstable


def _baselines(*values: float) -> Callable[[], float]:
    it: Iterator[float] = iter(values)
    return lambda: next(it)


def test_it_runs_a_phase_once_when_its_baselines_agree() -> None:
    attempts: list[int] = []

    result, pair = between_baselines("phase", lambda a: attempts.append(a) or a, _baselines(100.0, 105.0), repeats=2)

    assert attempts == [0]
    assert result == 0
    assert pair == BaselinePair(100.0, 105.0)


def test_it_repeats_a_phase_whose_baselines_disagree() -> None:
    attempts: list[int] = []

    result, pair = between_baselines(
        "phase", lambda a: attempts.append(a) or a, _baselines(1115.0, 8600.0, 9000.0, 9100.0), repeats=2
    )

    assert attempts == [0, 1]
    assert result == 1
    assert pair.agrees()


def test_it_gives_up_after_the_allowed_repeats() -> None:
    attempts: list[int] = []

    _, pair = between_baselines(
        "phase", lambda a: attempts.append(a) or a, _baselines(100.0, 200.0, 100.0, 200.0, 100.0, 200.0), repeats=2
    )

    assert attempts == [0, 1, 2]
    assert not pair.agrees()


def test_it_prints_unstable_instead_of_a_ratio_when_baselines_disagree() -> None:
    line = ratio_or_unstable("swarm_efficiency", 4772.0, BaselinePair(1115.0, 8600.0))

    assert line == "bench: swarm_efficiency=unstable (baselines 1115.0 and 8600.0 disagree by 671%)"


def test_it_divides_by_the_better_baseline_when_they_agree() -> None:
    line = ratio_or_unstable("agent_efficiency", 900.0, BaselinePair(1000.0, 950.0))

    assert line == "bench: agent_efficiency=0.900"


def test_a_ten_percent_gap_still_agrees_and_just_over_does_not() -> None:
    assert BaselinePair(100.0, 110.0).agrees()
    assert not BaselinePair(100.0, 110.5).agrees()
