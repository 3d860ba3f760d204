"""The load generator's gradient: the same nonzero values for every lease, in each codec's bytes.

Its copies must agree with their originals, as an honest swarm's do, so the
scale bench's verification costs what it would; a zero gradient agrees with nothing.
"""

from __future__ import annotations

import pytest
import torch

from crowdtrain_agent.sketch import compare, sketch
from tests.benchmarks.loadgen import FIXED_GRADIENT, fixed_gradient


@pytest.mark.parametrize(("codec", "dtype"), [("fp32", torch.float32), ("fp16", torch.float16)])
def test_the_simulated_gradient_decodes_to_its_value_in_each_codec(codec: str, dtype: torch.dtype) -> None:
    payload = b"".join(bytes(part) for _, part in fixed_gradient(70_001, codec))

    values = torch.frombuffer(bytearray(payload), dtype=dtype)

    assert values.numel() == 70_001
    assert torch.equal(values.float(), torch.full((70_001,), FIXED_GRADIENT))


def test_copies_of_the_simulated_gradient_agree_as_honest_ones_do() -> None:
    grad = torch.full((5_000,), FIXED_GRADIENT)

    assert compare(sketch(grad, seed=7), sketch(grad.clone(), seed=7)).agrees()
