"""A JSON body that does not fit its msgspec type is refused in the site's words, naming the field."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
import pytest

from crowdtrain.lib.jsonbodies import BodyError, convert


class Order(msgspec.Struct):
    item: str
    count: int
    note: str | None = None
    tags: Annotated[list[str], msgspec.Meta(max_length=2)] = []


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ({"count": 1}, "item is required"),
        ({"item": None, "count": 1}, "item is required"),
        ({"item": "tea", "count": "2"}, "count must be an integer, got '2'"),
        ({"item": "tea", "count": True}, "count must be an integer, got True"),
        ({"item": "tea", "count": 1, "note": 7}, "note must be a string, got 7"),
        ({"item": "tea", "count": 1, "note": {"a": 1}}, "note must be a string"),
        ({"item": "tea", "count": 1, "tags": ["a", "b", "c"]}, "tags must be a JSON array of length <= 2"),
        ({"item": "t\ud800", "count": 1}, "item is not text (it holds a lone surrogate); send UTF-8"),
        ({"item": "tea", "count": 1, "other": "\udc00"}, "other is not text (it holds a lone surrogate); send UTF-8"),
        ([1, 2], "the body must be a JSON object"),
    ],
)
def test_a_body_that_does_not_fit_is_refused_naming_the_field(body: Any, problem: str) -> None:
    with pytest.raises(BodyError) as refused:
        convert(body, Order)

    assert str(refused.value) == problem


def test_a_part_of_a_body_is_named_inside_its_field() -> None:
    with pytest.raises(BodyError, match="^hardware.count must be an integer, got 'x'$"):
        convert({"item": "gpu", "count": "x"}, Order, field="hardware")


def test_a_body_that_fits_comes_back_typed() -> None:
    order = convert({"item": "tea", "count": 2, "ignored": [1]}, Order)

    assert order == Order(item="tea", count=2)
