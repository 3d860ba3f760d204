"""The credit formula: one definition, for the site's ledger and the receipts the agent shows.

One credit is one gigaFLOP (10^9 floating-point operations) of accepted work: the samples of a lease whose
step commits, times the model's FLOPs per sample (forward and backward, from the model registry).
"""

from __future__ import annotations

FLOPS_PER_CREDIT = 1e9


def credit_for(samples: int, flops_per_sample: float) -> float:
    return samples * flops_per_sample / FLOPS_PER_CREDIT
