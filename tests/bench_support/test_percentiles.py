"""Percentiles and spreads of the scale bench: nearest rank, so a p99 is a latency some request really had."""

from __future__ import annotations

import math

import pytest

from tests.benchmarks.figures import band_pct, figure_line, percentile, skipped_line, spread_pct


def test_it_takes_the_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100

    assert percentile(values, 99) == 99.0
    assert percentile(values, 50) == 50.0
    assert percentile(values, 100) == 100.0


def test_a_p99_of_few_values_is_their_maximum() -> None:
    assert percentile([3.0, 1.0, 2.0], 99) == 3.0


def test_no_values_have_no_percentile() -> None:
    assert math.isnan(percentile([], 99))


def test_it_refuses_a_percentile_outside_0_to_100() -> None:
    with pytest.raises(ValueError, match="percentile must be in"):
        percentile([1.0], 0)


def test_the_spread_is_the_largest_over_the_smallest() -> None:
    assert spread_pct([2.0, 2.4, 2.2]) == pytest.approx(20.0)
    assert spread_pct([5.0]) == 0.0
    assert spread_pct([1.0, math.nan, 1.5]) == pytest.approx(50.0)


def test_figure_lines_read_like_w1s() -> None:
    assert figure_line("lease_p99_ms_100", 12.3456) == "bench: lease_p99_ms_100=12.346"
    assert figure_line("lease_cycles_per_s_1000", 1234.56) == "bench: lease_cycles_per_s_1000=1234.6"
    assert skipped_line("idle_cpu_pct_per_1000", "no Redis") == "bench: idle_cpu_pct_per_1000=skipped (no Redis)"


def test_the_band_is_the_narrowest_plus_or_minus_around_one_centre() -> None:
    assert band_pct([4.0, 6.0, 5.0]) == pytest.approx(20.0)  # 5 ± 20% holds 4 and 6
    assert spread_pct([4.0, 6.0]) == pytest.approx(50.0)  # the same series, read as largest over smallest
    assert band_pct([3.0, 3.0]) == 0.0
    assert band_pct([7.0]) == 0.0
    assert band_pct([1.0, math.inf, 3.0]) == pytest.approx(50.0)
