"""The aggregator's reconnects to the site: which pause comes after which failure, and what the operator reads.

Pinned when the hand-written loop became tenacity's: the ``n``-th failure of
an outage waits ``Backoff.delay(n)``, a welcomed connection that ends is the
first failure of a new outage, and only that first failure is a warning.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from crowdtrain_agent.backoff import Backoff
from crowdtrain_agent.protocol import CloseCode
from crowdtrain_backbone.server import BackboneServer

from .conftest import FakeSite, backbone_config


@dataclass(frozen=True)
class RecordedBackoff(Backoff):
    """The aggregator's policy, with short pauses, noting which failure each pause was asked for."""

    asked: list[int] = field(default_factory=list)

    def delay(self, attempt: int) -> float:
        self.asked.append(attempt)
        return 0.01


async def test_failures_wait_by_their_number_in_the_outage_and_a_drop_starts_a_new_one(
    site: FakeSite, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="crowdtrain_backbone")
    site.refuse_handshakes = [503, 502]
    backoff = RecordedBackoff(max_tries=None)
    server = BackboneServer(backbone_config(site.url, tmp_path), backoff=backoff)
    await server.start()
    try:
        await asyncio.wait_for(site.connected.wait(), 10)
        started = list(backoff.asked)
        site.refuse_handshakes = [503]
        assert site.ws is not None

        await site.ws.close(CloseCode.GOING_AWAY)
        await asyncio.sleep(0.05)
        await asyncio.wait_for(site.connected.wait(), 10)
    finally:
        await server.stop()

    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "busy" in r.getMessage()]
    assert started == [1, 2]
    assert backoff.asked == [1, 2, 1, 2]
    assert caplog.text.count("reconnected to the site after 2 tries") == 2
    assert len(warnings) == 2 and "(HTTP 503)" in warnings[0] and "(closed with code 4011)" in warnings[1]
    assert "failed (HTTP 502), try 2; next try in 0.0 s" in caplog.text
