"""Gradient sketches (groundwork for verification): honest copies of a gradient agree, hostile ones do not."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from crowdtrain_agent.sketch import CHUNK, SKETCH_SIZE, compare, sketch

SEEDS = st.integers(0, 2**62)


def _gradient(seed: int, n: int = 5000) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=generator) * torch.rand(n, generator=generator)  # uneven magnitudes


@settings(max_examples=30, deadline=None)
@given(data_seed=SEEDS, seed=SEEDS, scale=st.floats(0.01, 100.0))
def test_a_sketch_is_a_fixed_linear_map(data_seed: int, seed: int, scale: float) -> None:
    g, h = _gradient(data_seed), _gradient(data_seed + 1)

    assert sketch(g, seed) == sketch(g.clone(), seed)  # the same on every call
    assert sketch(g, seed) != sketch(g, seed + 1)
    combined = sketch(g + scale * h, seed)
    expected = [a + scale * b for a, b in zip(sketch(g, seed), sketch(h, seed), strict=True)]
    assert combined == pytest.approx(expected, rel=1e-4, abs=1e-3)


@settings(max_examples=30, deadline=None)
@given(data_seed=SEEDS, seed=SEEDS)
def test_honest_copies_agree(data_seed: int, seed: int) -> None:
    g = _gradient(data_seed)
    through_fp16 = g.to(torch.float16).to(torch.float32)  # fp16 transport
    other_order = torch.flip(torch.flip(g, [0]).to(torch.float64).cumsum(0).diff(prepend=torch.zeros(1)), [0])

    assert compare(sketch(g, seed), sketch(through_fp16, seed)).agrees()
    assert compare(sketch(g, seed), sketch(other_order.to(torch.float32), seed)).agrees()
    assert len(sketch(g, seed)) == SKETCH_SIZE


@settings(max_examples=30, deadline=None)
@given(data_seed=SEEDS, seed=SEEDS)
def test_sign_flipped_scaled_noisy_and_empty_gradients_disagree(data_seed: int, seed: int) -> None:
    g = _gradient(data_seed)
    honest = sketch(g, seed)
    noise = torch.randn(g.numel(), generator=torch.Generator().manual_seed(data_seed + 7))
    noise *= g.norm() / noise.norm()  # as large as the gradient, pointing anywhere

    flipped = compare(honest, sketch(-g, seed))
    assert flipped.cosine < -0.99 and not flipped.agrees()
    assert not compare(honest, sketch(3.0 * g, seed)).agrees()
    assert not compare(honest, sketch(0.5 * g, seed)).agrees()
    assert compare(honest, sketch(noise, seed)).cosine < 0.5
    assert not compare(honest, sketch(torch.zeros_like(g), seed)).agrees()
    assert not compare(sketch(torch.zeros_like(g), seed), sketch(torch.zeros_like(g), seed)).agrees()
    assert not compare(honest, [math.nan, *honest[1:]]).agrees()


def test_the_norm_survives_the_sketch() -> None:
    for data_seed in range(5):
        g = _gradient(data_seed, n=20_000)
        norm = math.sqrt(sum(x * x for x in sketch(g, seed=data_seed)))
        assert norm == pytest.approx(float(g.norm()), rel=0.25)


def test_a_gradient_longer_than_one_chunk_is_sketched_whole() -> None:
    g = torch.zeros(CHUNK + 5)
    g[-1] = 2.0  # only the last coordinate, in the second chunk

    assert sum(abs(x) for x in sketch(g, seed=1)) == pytest.approx(2.0)


def test_sketches_of_different_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="sketches of 3 and 2 numbers"):
        compare([1.0, 2.0, 3.0], [1.0, 2.0])
