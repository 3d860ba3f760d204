"""The model-size phase measures what it names: models of the sizes it prints, and waste as uploads no step used."""

from __future__ import annotations

import pytest

from tests.benchmarks.sizes import SIZES, param_count, wasted_fraction


@pytest.mark.parametrize(("size", "named"), [("10m", 10e6), ("100m", 100e6), ("350m", 350e6)])
def test_each_size_is_a_llama_of_about_that_many_parameters(size: str, named: float) -> None:
    assert size in SIZES
    assert 0.9 * named <= param_count(size) <= 1.1 * named


def test_uploads_no_committed_step_used_are_the_waste() -> None:
    assert wasted_fraction(committed_leases=12, slices=2, accepted_uploads=24) == 0.0
    assert wasted_fraction(committed_leases=9, slices=2, accepted_uploads=24) == pytest.approx(0.25)
    assert wasted_fraction(committed_leases=0, slices=2, accepted_uploads=0) == 0.0
