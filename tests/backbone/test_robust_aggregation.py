"""Robust means and norm clipping: outliers barely move them, honest steps are left alone, order never matters."""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from crowdtrain_backbone import robust
from crowdtrain_backbone.aggregation import AggregationRule, MeanRule, PendingUpload
from crowdtrain_backbone.robust import (
    CLIP_WINDOW,
    CenteredClipRule,
    ClipHistory,
    TrimmedMeanRule,
    build_rule,
    clip_contributions,
    trim_count,
    vector_norm,
)
from crowdtrain_backbone.slices import MemoryBudget, SliceState, initial_params

from .conftest import SLICE0, assignment

NUMEL = SLICE0[1] - SLICE0[0]
ROBUST_RULES: list[AggregationRule] = [TrimmedMeanRule(0.2), CenteredClipRule()]


def _grad(seed: int, numel: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * scale


def _uploads(seeds: list[int], sizes: list[int], numel: int) -> list[PendingUpload]:
    """Leases 1..n in lease-id order, each a gradient summed over its samples (so it grows with the count)."""
    return [
        PendingUpload(i + 1, 0, n, _grad(seed, numel) * n)
        for i, (seed, n) in enumerate(zip(seeds, sizes, strict=False))
    ]


def _total(uploads: list[PendingUpload]) -> int:
    return sum(u.num_samples for u in uploads)


def _per_sample_norm(upload: PendingUpload) -> float:
    return float((upload.grad * upload.scale).norm()) / upload.num_samples


leases = st.integers(1, 9).flatmap(
    lambda k: st.tuples(
        st.lists(st.integers(0, 10_000), min_size=k, max_size=k),
        st.lists(st.integers(1, 8), min_size=k, max_size=k),
        st.integers(1, 40),
    )
)


# ---------------------------------------------------------------------- the rules


@given(leases)
def test_a_trimmed_mean_that_trims_nothing_is_exactly_the_mean(drawn: tuple[list[int], list[int], int]) -> None:
    uploads = _uploads(*drawn)

    trimmed = TrimmedMeanRule(0.0).combine(uploads, _total(uploads))

    assert torch.equal(trimmed, MeanRule().combine(uploads, _total(uploads)))


@given(leases, st.floats(0.0, 0.49))
def test_robust_means_of_leases_that_agree_are_their_common_mean(
    drawn: tuple[list[int], list[int], int], trim_fraction: float
) -> None:
    seeds, sizes, numel = drawn
    common = _grad(seeds[0], numel)
    uploads = [PendingUpload(i + 1, 0, n, common * n) for i, n in enumerate(sizes)]

    for rule in (TrimmedMeanRule(trim_fraction), CenteredClipRule(), MeanRule()):
        torch.testing.assert_close(rule.combine(uploads, _total(uploads)), common, rtol=1e-5, atol=1e-6)


@settings(deadline=None)
@given(
    st.lists(st.integers(0, 10_000), min_size=5, max_size=10, unique=True),
    st.integers(4, 40),
    st.integers(1, 8),
    st.integers(0, 10),
)
def test_one_huge_outlier_moves_the_robust_means_far_less_than_the_mean(
    seeds: list[int], numel: int, outlier_samples: int, outlier_at: int
) -> None:
    base = _grad(-1 % 10_007, numel)
    honest = [base + 0.1 * _grad(s, numel) for s in seeds]
    leases = [(x, 4) for x in honest]
    leases.insert(outlier_at % (len(leases) + 1), (_grad(7, numel, 1e4) * outlier_samples, outlier_samples))
    uploads = [PendingUpload(i + 1, 0, n, x * n if n == 4 else x) for i, (x, n) in enumerate(leases)]
    target = torch.stack(honest).mean(dim=0)

    mean_error = (MeanRule().combine(uploads, _total(uploads)) - target).norm()

    for rule in ROBUST_RULES:
        error = (rule.combine(uploads, _total(uploads)) - target).norm()
        assert error < 0.01 * mean_error, (rule.name, float(error), float(mean_error))


@pytest.mark.parametrize("rule", ROBUST_RULES, ids=lambda r: r.name)
def test_the_robust_rules_read_the_slice_in_blocks_without_changing_a_bit(
    rule: AggregationRule, monkeypatch: pytest.MonkeyPatch
) -> None:
    uploads = _uploads(list(range(7)), [1, 2, 3, 4, 5, 6, 7], 1000)
    whole = rule.combine(uploads, _total(uploads))

    monkeypatch.setattr(robust, "BLOCK_ELEMENTS", 21)  # blocks of 3 columns, the last one short

    assert torch.equal(rule.combine(uploads, _total(uploads)), whole)


def test_too_few_leases_to_trim_take_the_mean_and_say_so(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="crowdtrain_backbone.robust")
    uploads = _uploads([1, 2, 3], [1, 2, 3], NUMEL)

    trimmed = TrimmedMeanRule(0.1).combine(uploads, 6)
    clipped = CenteredClipRule().combine(uploads[:2], 3)

    assert torch.equal(trimmed, MeanRule().combine(uploads, 6))
    assert torch.equal(clipped, MeanRule().combine(uploads[:2], 3))
    assert "trimmed mean of 3 contributions at trim fraction 0.1 would drop none; taking the plain mean" in caplog.text
    assert "centered clipping of 2 contributions has no majority; taking the plain mean" in caplog.text


def test_the_trim_count_leaves_at_least_one_value() -> None:
    assert [trim_count(n, 0.3) for n in (1, 3, 4, 10)] == [0, 0, 1, 3]
    assert trim_count(5, 0.49) == 2 and trim_count(2, 0.49) == 0 and trim_count(9, 7.0) == 4


def test_the_campaign_chooses_the_rule() -> None:
    chosen = [build_rule(assignment(aggregation=name)) for name in ("mean", "trimmed_mean", "centered_clip")]

    assert [type(rule) for rule in chosen] == [MeanRule, TrimmedMeanRule, CenteredClipRule]
    assert build_rule(assignment(aggregation="trimmed_mean", trim_fraction=0.3)).trim_fraction == 0.3  # type: ignore[attr-defined]


# ---------------------------------------------------------------------- norm clipping


@given(leases, st.lists(st.floats(1e-3, 1e3), max_size=CLIP_WINDOW), st.floats(0.5, 20.0))
def test_clipping_never_increases_a_norm_and_holds_each_to_the_bound(
    drawn: tuple[list[int], list[int], int], history: list[float], clip_factor: float
) -> None:
    uploads = _uploads(*drawn)

    clipping = clip_contributions(uploads, ClipHistory(history), clip_factor)

    assert clipping.bound is not None
    for before, after in zip(uploads, clipping.uploads, strict=True):
        assert after.grad is before.grad and after.scale <= 1.0  # the held tensor is shared, never changed
        assert _per_sample_norm(after) <= _per_sample_norm(before) * (1 + 1e-6)
        assert _per_sample_norm(after) <= clipping.bound * (1 + 1e-5)
        assert (after is before) == (before.lease_id not in clipping.clipped)


@given(leases, st.lists(st.floats(1e-3, 1e3), max_size=CLIP_WINDOW))
def test_a_clip_factor_of_0_changes_nothing(drawn: tuple[list[int], list[int], int], history: list[float]) -> None:
    uploads = _uploads(*drawn)

    clipping = clip_contributions(uploads, ClipHistory(history), 0.0)

    assert all(a is b for a, b in zip(clipping.uploads, uploads, strict=True))
    assert clipping.clipped == [] and clipping.recorded == [] and clipping.bound is None


def test_a_contribution_far_above_the_recent_median_is_cut_to_the_bound() -> None:
    unit = torch.ones(4) / 2  # norm 1
    uploads = [PendingUpload(1, 0, 2, unit * 2), PendingUpload(2, 0, 1, unit * 0.0), PendingUpload(3, 0, 1, unit * 50)]
    history = ClipHistory([1.0] * 10)

    clipping = clip_contributions(uploads, history, 4.0)

    # The median of ten 1s and this step's 1 and 50 (its zero says nothing) is 1: the bound is 4.
    assert (clipping.median, clipping.bound, clipping.clipped) == (1.0, 4.0, [3])
    assert clipping.uploads[2].scale == pytest.approx(4 / 50)
    assert clipping.recorded == [1.0, 4.0]  # what the next steps see: the norm after clipping, no zeros
    assert list(history.norms) == [1.0] * 10  # recorded only once the step is applied


def test_the_clip_history_keeps_the_last_64_norms() -> None:
    history = ClipHistory(float(i) for i in range(1, 60))

    history.record_([100.0] * 10)

    assert len(history.norms) == CLIP_WINDOW and history.to_list()[-11:] == [59.0] + [100.0] * 10


def test_norms_are_the_same_whatever_the_chunking() -> None:
    big = _grad(3, 200_003)

    assert vector_norm(big) == float(f"{float(big.double().norm()):.9g}")


# ---------------------------------------------------------------------- a whole step on a slice


@settings(deadline=None, max_examples=30)
@given(
    st.sampled_from(["mean", "trimmed_mean", "centered_clip"]),
    st.permutations(list(range(1, 8))),
    st.permutations(list(range(1, 8))),
)
def test_a_step_is_the_same_whatever_order_its_uploads_arrived_in(
    aggregation: str, arrived: list[int], named: list[int]
) -> None:
    spec = assignment(staleness=2, aggregation=aggregation, clip_factor=2.0, trim_fraction=0.2)
    grads = {lease: _grad(lease, NUMEL, 30.0 if lease == 5 else 1.0) for lease in range(1, 8)}  # lease 5 is clipped
    results = []

    for order in (sorted(arrived), arrived):
        state = SliceState(spec, initial_params(spec), 0, MemoryBudget(1 << 30))
        for lease in order:
            n = 1 + lease % 3
            state.add_pending(PendingUpload(lease, 0, n, grads[lease] * n))
        total = sum(1 + lease % 3 for lease in named)
        state.finish_step(state.apply_step_(state.collect(named, total), total), named)
        results.append((state.param.detach().clone(), state.clip_history.to_list(), state.clipped))

    assert torch.equal(results[0][0], results[1][0])
    assert results[0][1] == results[1][1] and results[0][2] == results[1][2] == 1
