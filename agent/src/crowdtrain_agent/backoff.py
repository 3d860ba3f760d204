"""How long a client waits between connection tries: the agent's control channel and the aggregator's site link."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """Exponential delays between connection tries, capped, spread by jitter, optionally for a limited number of tries.

    Try ``n`` (1-based) waits ``min(max_s, base_s * factor**(n-1))`` scaled by a random
    factor in ``[1 - jitter, 1]``: never longer than ``max_s``, which the "pauses of up
    to ..." log lines promise, and never all at once after a restart (a crowd of agents,
    or several aggregators, spread out instead of knocking together).
    """

    base_s: float = 0.5
    factor: float = 2.0
    max_s: float = 60.0
    jitter: float = 0.5  # fraction of the delay that is random
    max_tries: int | None = 38  # about 24 minutes with the defaults; None: never give up (a service)

    def __post_init__(self) -> None:
        if not (0 < self.base_s <= self.max_s and self.factor >= 1 and 0 <= self.jitter <= 1):
            raise ValueError(f"backoff needs 0 < base_s <= max_s, factor >= 1 and jitter in [0, 1], got {self!r}")
        if self.max_tries is not None and self.max_tries < 1:
            raise ValueError(f"max_tries must be at least 1 or None (no limit), got {self.max_tries}")

    def delay(self, attempt: int) -> float:
        """Seconds to wait before connection try number ``attempt`` (1-based)."""
        raw = min(self.max_s, self.base_s * self.factor ** max(0, attempt - 1))
        return raw * (1.0 - self.jitter * random.random())

    def exhausted(self, tries: int) -> bool:
        """Whether ``tries`` failed tries in a row are all this policy allows."""
        return self.max_tries is not None and tries >= self.max_tries
