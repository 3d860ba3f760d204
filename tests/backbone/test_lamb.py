"""LAMB's arithmetic against the paper's formulas, written out by hand."""

from __future__ import annotations

import pytest
import torch

from crowdtrain_backbone.lamb import Lamb


def _by_hand(w: torch.Tensor, grads: list[torch.Tensor], lr: float, b1: float, b2: float, eps: float,
             wd: float) -> torch.Tensor:  # fmt: skip
    w, m, v = w.double().clone(), torch.zeros_like(w, dtype=torch.float64), torch.zeros_like(w, dtype=torch.float64)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        u = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps) + wd * w
        w = w - lr * (w.norm() / u.norm()) * u
    return w.float()


def test_three_steps_follow_algorithm_2_of_the_paper() -> None:
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(4, 5, generator=gen)
    grads = [torch.randn(4, 5, generator=gen) for _ in range(3)]
    param = torch.nn.Parameter(w0.clone())
    opt = Lamb([param], lr=0.1, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.05)

    for g in grads:
        param.grad = g.clone()
        opt.step()

    torch.testing.assert_close(param.detach(), _by_hand(w0, grads, 0.1, 0.9, 0.99, 1e-6, 0.05), rtol=1e-5, atol=1e-6)


def test_segments_of_a_flat_parameter_each_get_their_own_trust_ratio() -> None:
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(6, generator=gen), 100 * torch.randn(3, generator=gen)
    ga, gb = torch.randn(6, generator=gen), torch.randn(3, generator=gen)
    flat = torch.nn.Parameter(torch.cat([a, b]))
    opt = Lamb([flat], lr=0.1, segments=[[6, 3]])

    flat.grad = torch.cat([ga, gb])
    opt.step()

    expected = torch.cat([_by_hand(a, [ga], 0.1, 0.9, 0.999, 1e-6, 0.0), _by_hand(b, [gb], 0.1, 0.9, 0.999, 1e-6, 0.0)])
    torch.testing.assert_close(flat.detach(), expected, rtol=1e-5, atol=1e-5)


def test_a_zero_weight_tensor_takes_a_plain_adam_sized_step() -> None:
    param = torch.nn.Parameter(torch.zeros(3))
    opt = Lamb([param], lr=0.5, eps=0.0)

    param.grad = torch.tensor([2.0, -3.0, 0.5])
    opt.step()

    torch.testing.assert_close(param.detach(), torch.tensor([-0.5, 0.5, -0.5]))


def test_segments_that_do_not_add_up_are_refused() -> None:
    with pytest.raises(ValueError, match=r"must be positive and add up to the parameter's 9 elements"):
        Lamb([torch.nn.Parameter(torch.zeros(9))], segments=[[6, 2]])
