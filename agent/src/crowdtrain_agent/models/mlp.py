"""A plain multi-layer perceptron classifier (the benchmark's workload W1)."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, in_dim: int, hidden: Sequence[int], classes: int) -> None:
        super().__init__()
        widths = [in_dim, *hidden]
        layers: list[nn.Module] = []
        for a, b in pairwise(widths):
            layers += [nn.Linear(a, b), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
