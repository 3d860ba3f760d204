"""LAMB campaigns cut their parameter vector only between tensors, as evenly as the tensors allow."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crowdtrain.campaigns.models import Campaign
from crowdtrain.scheduler import backbone
from crowdtrain_agent.models import get_model
from tests.factories import TINY_GPT, make_aggregator, make_campaign

sizes_lists = st.lists(st.integers(min_value=1, max_value=1000), min_size=1, max_size=40)


@given(sizes_lists, st.integers(min_value=1, max_value=8))
def test_cuts_fall_on_tensor_boundaries_and_no_slice_is_empty(sizes: list[int], parts: int) -> None:
    if parts > len(sizes):
        parts = len(sizes)
    boundaries = {sum(sizes[:i]) for i in range(len(sizes) + 1)}

    bounds = backbone.slice_bounds(sum(sizes), parts, sizes)

    assert len(bounds) == parts
    assert bounds[0][0] == 0 and bounds[-1][1] == sum(sizes)
    assert all(a[1] == b[0] for a, b in pairwise(bounds))
    assert all(start < end for start, end in bounds)
    assert {edge for pair in bounds for edge in pair} <= boundaries


def test_each_cut_takes_the_boundary_nearest_the_even_split() -> None:
    bounds = backbone.slice_bounds(67, 2, [32, 8, 24, 3])

    assert bounds == [(0, 32), (32, 67)]


def test_without_tensor_sizes_slices_are_even_and_cut_at_multiples_of_16() -> None:
    assert backbone.slice_bounds(67, 2) == [(0, 32), (32, 67)]
    assert backbone.slice_bounds(6532, 2) == [(0, 3264), (3264, 6532)]


@given(st.integers(min_value=1, max_value=10**7), st.integers(min_value=1, max_value=16))
def test_elementwise_slices_are_contiguous_nearly_even_and_aligned(count: int, parts: int) -> None:
    parts = min(parts, count)

    bounds = backbone.slice_bounds(count, parts)

    assert bounds[0][0] == 0 and bounds[-1][1] == count and len(bounds) == parts
    assert all(a[1] == b[0] for a, b in pairwise(bounds)) and all(s < e for s, e in bounds)
    if count >= backbone.SLICE_ALIGN * parts * 2:
        assert all(start % backbone.SLICE_ALIGN == 0 for start, _ in bounds)
        assert max(e - s for s, e in bounds) - min(e - s for s, e in bounds) <= 2 * backbone.SLICE_ALIGN


def test_more_slices_than_tensors_is_refused() -> None:
    with pytest.raises(ValueError, match="2 parameter tensors, too few for 3"):
        backbone.slice_bounds(10, 3, [4, 6])


@pytest.mark.django_db
def test_a_lamb_campaign_is_assigned_whole_tensor_slices() -> None:
    campaign = make_campaign(slices=2, optimizer={"name": "lamb"})
    campaign.slices.all().delete()
    make_aggregator("spare-1"), make_aggregator("spare-2")

    backbone.assign_waiting_campaigns()

    shapes = get_model("gpt").param_shapes(TINY_GPT)
    edges, offset = {0}, 0
    for shape in shapes:
        offset += math.prod(shape)
        edges.add(offset)
    bounds = list(campaign.slices.order_by("index").values_list("start", "end"))
    assert len(bounds) == 2 and bounds[0][0] == 0 and bounds[-1][1] == campaign.param_count
    assert {edge for pair in bounds for edge in pair} <= edges
    assert Campaign.objects.get(pk=campaign.pk).optimizer["name"] == "lamb"
