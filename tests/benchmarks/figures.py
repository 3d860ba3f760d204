"""The arithmetic behind the bench's printed figures: percentiles, baseline agreement, ``bench:`` lines.

Pure functions, so ``tests/bench_support`` can check them without starting anything.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Two measurements of one baseline that differ by more than this did not measure the same machine.
BASELINE_TOLERANCE_PCT = 10.0


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0 < q <= 100) of ``values``; NaN when there are none.

    Nearest rank, not interpolation: a p99 is a latency some request really had.

    Raises:
        ValueError: if ``q`` is outside (0, 100].
    """
    if not 0.0 < q <= 100.0:
        raise ValueError(f"percentile must be in (0, 100], got {q!r}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = math.ceil(q / 100.0 * len(ordered))
    return float(ordered[max(rank, 1) - 1])


def disagreement_pct(a: float, b: float) -> float:
    """How far the larger of two positive measurements is above the smaller, in percent (inf if one is 0)."""
    low, high = sorted((a, b))
    if low <= 0.0:
        return math.inf if high > 0.0 else 0.0
    return (high - low) / low * 100.0


def spread_pct(values: Iterable[float]) -> float:
    """The largest of ``values`` over the smallest, as percent above it (0 for a perfectly flat series)."""
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < 2:
        return 0.0
    return disagreement_pct(min(finite), max(finite))


def band_pct(values: Iterable[float]) -> float:
    """The narrowest ``±x`` percent band around one centre that holds every value: ``x`` (0 when flat).

    The lenient reading of "flat within ±20%": the values lie within 20% of
    one figure, the best centre ``(max + min) / 2``. ``spread_pct`` is the
    strict one, the largest over the smallest; a band of ±20% is a spread of up to 50%.
    """
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < 2:
        return 0.0
    low, high = min(finite), max(finite)
    return (high - low) / (high + low) * 100.0 if high + low > 0.0 else 0.0


@dataclass(frozen=True)
class BaselinePair:
    """A baseline measured right before and right after the phase it divides."""

    before: float
    after: float

    @property
    def disagreement_pct(self) -> float:
        return disagreement_pct(self.before, self.after)

    def agrees(self, tolerance_pct: float = BASELINE_TOLERANCE_PCT) -> bool:
        return self.disagreement_pct <= tolerance_pct

    @property
    def best(self) -> float:
        # Other load on the machine only lowers a baseline, and a lowered baseline flatters the platform.
        return max(self.before, self.after)


def between_baselines(what: str, phase: Callable[[int], T], baseline: Callable[[], float],
                      repeats: int) -> tuple[T, BaselinePair]:  # fmt: skip
    """Run ``phase(attempt)`` between two measurements of its baseline; run it again while they disagree.

    Returns:
        The last attempt's result and its baseline pair, which may still disagree
        after ``repeats`` repeats (the caller then prints ``unstable``).
    """
    attempt = 0
    while True:
        before = baseline()
        result = phase(attempt)
        pair = BaselinePair(before, baseline())
        if pair.agrees() or attempt >= repeats:
            return result, pair
        attempt += 1
        logger.warning(
            "%s: baselines %.1f and %.1f samples/s disagree by %.0f%% (over %.0f%%): the machine's load changed; "
            "repeating the phase (%d of %d)", what, pair.before, pair.after, pair.disagreement_pct,
            BASELINE_TOLERANCE_PCT, attempt, repeats,
        )  # fmt: skip


def ratio_or_unstable(name: str, value: float, baseline: BaselinePair,
                      tolerance_pct: float = BASELINE_TOLERANCE_PCT) -> str:  # fmt: skip
    """The ``bench:`` line of ``value / baseline``, or ``unstable`` when the two baselines disagree."""
    if not baseline.agrees(tolerance_pct):
        return (
            f"bench: {name}=unstable (baselines {format_value(baseline.before)} and {format_value(baseline.after)} "
            f"disagree by {baseline.disagreement_pct:.0f}%)"
        )
    return figure_line(name, value / baseline.best)


def format_value(value: float) -> str:
    """Three decimals below 100, one above: the precision w1 has always printed; a count as it is."""
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf"
    return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"


def figure_line(name: str, value: float, note: str = "") -> str:
    return f"bench: {name}={format_value(value)}" + (f" ({note})" if note else "")


def skipped_line(name: str, reason: str) -> str:
    return f"bench: {name}=skipped ({reason})"
