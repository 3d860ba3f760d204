"""How long a client waits between connection tries: the agent's control channel and the aggregator's site link."""

from __future__ import annotations

import random
from dataclasses import dataclass

from tenacity import RetryCallState, Retrying, stop_after_attempt, stop_never, wait_exponential
from tenacity.stop import stop_base
from tenacity.wait import wait_base


class wait_shortened(wait_base):  # noqa: N801 (named like tenacity's own strategies, which it composes with)
    """Another wait, shortened by a random fraction of up to ``jitter``: spread out, never longer than promised.

    tenacity's own jitter adds to a delay; the "pauses of up to ..." log lines
    promise a ceiling, so this one only takes away.
    """

    def __init__(self, inner: wait_base, jitter: float) -> None:
        self.inner = inner
        self.jitter = jitter

    def __call__(self, retry_state: RetryCallState) -> float:
        return self.inner(retry_state) * (1.0 - self.jitter * random.random())


@dataclass(frozen=True)
class Backoff:
    """Exponential delays between connection tries, capped, spread by jitter, optionally for a limited number of tries.

    Try ``n`` (1-based) waits ``min(max_s, base_s * factor**(n-1))`` scaled by a random
    factor in ``[1 - jitter, 1]``: never longer than ``max_s``, which the "pauses of up
    to ..." log lines promise, and never all at once after a restart (a crowd of agents,
    or several aggregators, spread out instead of knocking together). The policy is
    tenacity's: ``wait()`` and ``stop()`` plug into a ``Retrying``. The control channel
    and the site link run one ``AsyncRetrying`` per outage (a welcomed connection
    starts a fresh count) and number their pauses across it, so they ask ``delay``
    for try ``n`` of the outage; ``exhausted`` asks ``stop()`` the same way.
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

    def wait(self) -> wait_base:
        """The tenacity wait before try ``attempt_number`` (1-based), as ``delay`` describes."""
        return wait_shortened(
            wait_exponential(multiplier=self.base_s, exp_base=self.factor, max=self.max_s), self.jitter
        )

    def stop(self) -> stop_base:
        """The tenacity stop after ``max_tries`` failed tries, or never."""
        return stop_never if self.max_tries is None else stop_after_attempt(self.max_tries)

    def delay(self, attempt: int) -> float:
        """Seconds to wait before connection try number ``attempt`` (1-based)."""
        return self.wait()(_tries(attempt))

    def exhausted(self, tries: int) -> bool:
        """Whether ``tries`` failed tries in a row are all this policy allows."""
        return tries >= 1 and self.stop()(_tries(tries))


def _tries(attempt: int) -> RetryCallState:
    """A tenacity call state at try ``attempt``: all that the wait and stop strategies above read."""
    state = RetryCallState(Retrying(), None, (), {})
    state.attempt_number = max(1, attempt)
    return state
