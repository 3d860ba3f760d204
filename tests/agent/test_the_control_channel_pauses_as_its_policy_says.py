"""The control channel's reconnects: which pause comes before which try, what the volunteer sees, when it gives up.

Pinned when the hand-written loop became tenacity's: a failed try ``n`` waits
``Backoff.delay(n + 1)``, a dropped connection waits ``delay(1)`` and counts its
tries afresh, and the agent gives up after ``max_tries`` tries in a row.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest

from crowdtrain_agent.control import AgentStopped, Backoff, ControlChannel
from crowdtrain_agent.protocol import PROTOCOL_VERSION, AgentHello, DeviceInfo

from .fakes import GOOD_TOKEN, FakeSite

HELLO = AgentHello(
    protocol_version=PROTOCOL_VERSION, agent_version="test",
    device=DeviceInfo(kind="cpu", name="test cpu", threads=1, flops_per_s=1e9),
)  # fmt: skip


@dataclass(frozen=True)
class RecordedBackoff(Backoff):
    """The shared policy, with no pauses, noting which try each pause was asked for."""

    asked: list[int] = field(default_factory=list)

    def delay(self, attempt: int) -> float:
        self.asked.append(attempt)
        return 0.0


@pytest.fixture
async def site() -> AsyncIterator[FakeSite]:
    fake = FakeSite()
    await fake.start()
    yield fake
    await fake.stop()


def _control_url(site: FakeSite) -> str:
    return site.url.replace("http://", "ws://") + "/ws/agent/"


async def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


async def test_failed_tries_wait_for_the_next_tries_pause_and_the_volunteer_sees_the_count(
    site: FakeSite, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="crowdtrain_agent")
    site.refuse_handshakes = [503, 502]
    backoff = RecordedBackoff(max_tries=5)
    states: list[str] = []
    channel = ControlChannel(_control_url(site), GOOD_TOKEN, HELLO, on_state=states.append, backoff=backoff)

    running = asyncio.create_task(channel.run())
    await asyncio.wait_for(channel.welcomed(), 10)
    await channel.close()
    await asyncio.wait_for(running, 10)

    assert backoff.asked == [2, 3]
    assert states[:3] == ["reconnecting to the site (try 2)", "reconnecting to the site (try 3)", "connected"]
    assert [r.getMessage() for r in caplog.records if "busy or unreachable" in r.getMessage()] == [
        f"the site at {_control_url(site)} is busy or unreachable (HTTP 503); the agent keeps trying, with growing "
        "pauses of up to 60 s"
    ]
    assert "connect try 2 to" in caplog.text and "HTTP 502" in caplog.text


async def test_a_dropped_connection_waits_the_first_pause_and_counts_its_tries_afresh(
    site: FakeSite, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="crowdtrain_agent")
    site.refuse_handshakes = [503]
    backoff = RecordedBackoff(max_tries=2)
    states: list[str] = []
    channel = ControlChannel(_control_url(site), GOOD_TOKEN, HELLO, on_state=states.append, backoff=backoff)
    running = asyncio.create_task(channel.run())
    await asyncio.wait_for(channel.welcomed(), 10)
    site.refuse_handshakes = [503]  # one failed try after the drop: within max_tries=2 only if the count restarted

    assert site.current is not None
    site.current.transport.abort()
    await _until(lambda: channel.connections == 2)
    await channel.close()
    await asyncio.wait_for(running, 10)

    assert backoff.asked == [2, 1, 2]
    assert states[2:6] == [
        "disconnected from the site",
        "reconnecting to the site (try 1)",
        "reconnecting to the site (try 2)",
        "connected",
    ]
    assert "reconnected after 2 tries" in caplog.text


async def test_it_gives_up_after_max_tries_in_a_row_with_a_hint(caplog: pytest.LogCaptureFixture) -> None:
    backoff = RecordedBackoff(max_tries=3)
    states: list[str] = []
    channel = ControlChannel("ws://127.0.0.1:9/ws/agent/", GOOD_TOKEN, HELLO, on_state=states.append, backoff=backoff)

    with pytest.raises(AgentStopped, match="after 3 tries; check the network and the --server address"):
        await asyncio.wait_for(channel.run(), 30)

    assert backoff.asked[:2] == [2, 3]  # tenacity also works out the pause after the last try, never taken
    assert states == ["reconnecting to the site (try 2)", "reconnecting to the site (try 3)"]
    assert "giving up on ws://127.0.0.1:9/ws/agent/ after 3 tries" in caplog.text
    assert channel.fatal is not None


async def test_close_while_unreachable_ends_run_without_an_error() -> None:
    backoff = RecordedBackoff(max_tries=None)
    channel = ControlChannel("ws://127.0.0.1:9/ws/agent/", GOOD_TOKEN, HELLO, backoff=backoff)
    running = asyncio.create_task(channel.run())
    await _until(lambda: len(backoff.asked) >= 3)

    await channel.close()

    await asyncio.wait_for(running, 10)
    assert running.done() and running.exception() is None and channel.fatal is None
