"""Coverage precedence: each sample of a shard counts once, in the most advanced state any lease gives it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from crowdtrain.ops.coverage import STATES, Span, lease_state, shard_counts

spans = st.lists(
    st.tuples(st.integers(-5, 45), st.integers(0, 20), st.sampled_from(STATES)).map(
        lambda t: (t[0], t[0] + t[1], t[2])
    ),
    max_size=12,
)


def brute_force(size: int, spans: list[Span]) -> dict[str, int]:
    """One sample at a time: the first state of STATES (the most advanced) among the spans that cover it."""
    counts = dict.fromkeys(STATES, 0)
    for sample in range(size):
        covering = [state for start, end, state in spans if start <= sample < end]
        counts[min(covering, key=STATES.index) if covering else "untouched"] += 1
    return counts


@given(size=st.integers(0, 40), spans=spans)
def test_it_agrees_with_counting_sample_by_sample(size: int, spans: list[Span]) -> None:
    counts = shard_counts(size, spans)

    assert counts == brute_force(size, spans)


@given(
    size=st.integers(0, 10**7),
    spans=st.lists(
        st.tuples(st.integers(-(10**6), 10**7), st.integers(0, 10**7), st.sampled_from(STATES)).map(
            lambda t: (t[0], t[0] + t[1], t[2])
        ),
        max_size=50,
    ),
)
def test_the_counts_of_a_shard_always_sum_to_its_size(size: int, spans: list[Span]) -> None:
    counts = shard_counts(size, spans)

    assert sum(counts.values()) == size
    assert set(counts) == set(STATES) and min(counts.values()) >= 0


def test_a_later_lease_over_done_samples_does_not_hide_them() -> None:
    counts = shard_counts(10, [(0, 6, "done"), (4, 10, "leased"), (0, 10, "returned")])

    assert (counts["done"], counts["leased"], counts["returned"], counts["untouched"]) == (6, 4, 0, 0)


def test_a_lease_takes_the_state_of_its_record_and_of_its_check() -> None:
    cases = {
        ("accepted", True, "passed"): "verified",
        ("accepted", True, None): "done",
        ("accepted", True, "open"): "done",
        ("accepted", False, "passed"): "verified",
        ("accepted", False, None): "accepted",
        ("active", False, None): "leased",
        ("accepted", True, "failed"): "rejected",
        ("rejected", False, None): "rejected",
        ("expired", False, None): "returned",
        ("released", False, None): "returned",
        ("expired", False, "passed"): "returned",  # a rollback retired it: its samples go round again
    }

    found = {case: lease_state(*case) for case in cases}

    assert found == cases
