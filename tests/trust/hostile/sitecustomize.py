"""A hostile volunteer for the trust tests: the real agent, with each gradient tampered with before upload.

Python imports ``sitecustomize`` at start-up from ``PYTHONPATH``; an agent
started with this folder there and ``CROWDTRAIN_TEST_HOSTILE`` set is what a
volunteer running a modified client would be. Nothing of the product changes.
"""

from __future__ import annotations

import os

MODE = os.environ.get("CROWDTRAIN_TEST_HOSTILE", "")

if MODE:
    import math
    from typing import Any

    import torch

    from crowdtrain_agent import trainer

    honest = trainer.compute_gradient

    def tampered(*args: Any, **kwargs: Any) -> Any:
        result = honest(*args, **kwargs)
        grad = result.grad
        if MODE == "flip":  # scaled and sign-flipped: undoes ten honest contributions
            grad.mul_(-10.0)
        elif MODE == "collude":  # made up the same way by every account of one person, so they agree
            grad.mul_(-5.0)
        elif MODE == "noise":  # as large as an honest gradient, pointing anywhere
            scale = float(grad.norm()) / math.sqrt(max(grad.numel(), 1))
            grad.copy_(torch.randn(grad.shape, generator=torch.Generator().manual_seed(grad.numel())) * scale)
        elif MODE == "nan":
            grad[::7] = math.nan
        else:
            raise SystemExit(f"CROWDTRAIN_TEST_HOSTILE={MODE!r}: use flip, collude, noise or nan")
        return result

    trainer.compute_gradient = tampered
    if MODE == "nan":  # a modified client does not stop its own NaNs: the aggregators must
        trainer.finite_or_raise = lambda grad, codec="fp32": None
