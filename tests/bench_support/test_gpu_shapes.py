"""The GPU benchmark's --shapes: GLOBALxMICRO pairs, refused with the reason when malformed or impossible."""

from __future__ import annotations

import argparse

import pytest

from tests.benchmarks.gpu import _shapes


def test_shapes_are_global_batch_by_microbatch() -> None:
    assert _shapes("1024x64, 16384x1024") == [(1024, 64), (16384, 1024)]


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("1024", "GLOBALxMICRO"),
        ("1024xsixty", "GLOBALxMICRO"),
        ("64x1024", "microbatch <= global batch"),
        ("1024x0", "1 <= microbatch"),
    ],
)
def test_a_malformed_or_impossible_shape_is_refused_saying_why(text: str, says: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=says):
        _shapes(text)
