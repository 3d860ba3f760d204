"""The learning-rate schedule of OptimizerSpec: linear warmup, then constant or cosine down to a floor."""

from __future__ import annotations

import math
from itertools import pairwise

from hypothesis import given
from hypothesis import strategies as st

from crowdtrain_agent.protocol import OptimizerSpec
from crowdtrain_agent.protocol.schema import from_dict, to_dict

warmups = st.integers(min_value=0, max_value=200)
totals = st.integers(min_value=1, max_value=500)
ratios = st.floats(min_value=0.0, max_value=1.0)
steps = st.integers(min_value=0, max_value=1000)


def _cosine(warmup: int, total: int, ratio: float) -> OptimizerSpec:
    return OptimizerSpec(warmup_steps=min(warmup, total), schedule="cosine", total_steps=total, min_lr_ratio=ratio)


@given(warmups, totals, ratios, steps)
def test_the_multiplier_is_never_negative_nor_above_one(warmup: int, total: int, ratio: float, step: int) -> None:
    spec = _cosine(warmup, total, ratio)

    value = spec.lr_multiplier(step)

    assert 0.0 <= value <= 1.0


@given(warmups, totals, ratios, steps)
def test_warmup_rises_monotonically_to_one(warmup: int, total: int, ratio: float, step: int) -> None:
    spec = _cosine(warmup, total, ratio)
    w = spec.warmup_steps

    inside = [spec.lr_multiplier(s) for s in range(w)]

    assert all(a < b for a, b in pairwise(inside))
    if w:
        assert inside[0] == 1.0 / w and inside[-1] == 1.0


@given(warmups, totals, ratios)
def test_cosine_never_rises_after_warmup(warmup: int, total: int, ratio: float) -> None:
    spec = _cosine(warmup, total, ratio)

    after = [spec.lr_multiplier(s) for s in range(spec.warmup_steps, total + 3)]

    assert all(b <= a + 1e-12 for a, b in pairwise(after))


@given(warmups, totals, ratios, st.integers(min_value=0, max_value=100))
def test_cosine_ends_at_the_min_ratio_and_stays_there(warmup: int, total: int, ratio: float, extra: int) -> None:
    spec = _cosine(warmup, total, ratio)

    value = spec.lr_multiplier(total + extra)

    assert math.isclose(value, ratio, abs_tol=1e-12)


@given(warmups, steps)
def test_a_constant_schedule_holds_the_full_rate_after_warmup(warmup: int, step: int) -> None:
    spec = OptimizerSpec(warmup_steps=warmup)

    value = spec.lr_multiplier(warmup + step)

    assert value == 1.0


def test_the_default_optimizer_has_no_schedule() -> None:
    assert [OptimizerSpec().lr_multiplier(s) for s in (0, 1, 10_000)] == [1.0, 1.0, 1.0]


def test_an_optimizer_spec_with_a_schedule_round_trips() -> None:
    spec = OptimizerSpec(name="lamb", lr=2e-3, warmup_steps=5, schedule="cosine", min_lr_ratio=0.1, total_steps=50)

    assert from_dict(OptimizerSpec, to_dict(spec)) == spec
