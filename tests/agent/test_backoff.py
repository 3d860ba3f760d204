"""One reconnect policy for the agent and the aggregator: exponential, capped, jittered, with or without a try limit."""

from __future__ import annotations

import pytest

from crowdtrain_agent.backoff import Backoff
from crowdtrain_agent.control import ControlChannel
from crowdtrain_backbone.site_link import SITE_BACKOFF


def test_delays_double_until_the_cap_and_never_pass_it() -> None:
    backoff = Backoff(base_s=1.0, factor=2.0, max_s=8.0, jitter=0.0)

    delays = [backoff.delay(attempt) for attempt in range(1, 7)]

    assert delays == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]


def test_jitter_spreads_a_delay_below_its_nominal_value_only() -> None:
    backoff = Backoff(base_s=4.0, max_s=4.0, jitter=0.5)

    delays = [backoff.delay(5) for _ in range(2000)]

    assert 2.0 <= min(delays) < 2.2 and 3.8 < max(delays) <= 4.0


def test_the_agent_gives_up_after_its_tries_and_the_aggregator_never_does() -> None:
    agent = Backoff()

    assert not agent.exhausted(37) and agent.exhausted(38)
    assert SITE_BACKOFF.max_tries is None and not SITE_BACKOFF.exhausted(10**6)
    assert SITE_BACKOFF.max_s == 30.0


def test_the_agents_control_channel_uses_the_shared_policy_by_default() -> None:
    channel = ControlChannel("http://127.0.0.1:1", "token", hello=None)  # type: ignore[arg-type]

    assert channel._backoff == Backoff()


@pytest.mark.parametrize(
    "fields", [{"base_s": 0.0}, {"base_s": 2.0, "max_s": 1.0}, {"factor": 0.5}, {"jitter": 1.5}, {"max_tries": 0}]
)
def test_a_policy_that_cannot_work_is_refused_when_made(fields: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="backoff needs|max_tries must be"):
        Backoff(**fields)  # type: ignore[arg-type]
