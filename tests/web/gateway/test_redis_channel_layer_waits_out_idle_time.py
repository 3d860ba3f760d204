"""On Redis, a consumer with nothing to do for longer than redis-py's default read timeout still gets its next event."""

from __future__ import annotations

import asyncio

import pytest
from channels.layers import channel_layers
from django.conf import settings

# redis-py 8 gives up on a read after 5 s by default; channels_redis's blocking pop waits up to 5 s.
LONGER_THAN_REDIS_PY_DEFAULT_S = 6.0


@pytest.mark.skipif(not settings.REDIS_URL, reason="the in-memory channel layer has no read timeout")
async def test_an_idle_receive_outlasts_redis_pys_default_read_timeout() -> None:
    layer = channel_layers.make_backend("default")
    channel = await layer.new_channel()

    async def send_late() -> None:
        await asyncio.sleep(LONGER_THAN_REDIS_PY_DEFAULT_S)
        await layer.send(channel, {"type": "aggregator.step", "version": 3})

    sender = asyncio.create_task(send_late())
    try:
        received = await asyncio.wait_for(layer.receive(channel), timeout=LONGER_THAN_REDIS_PY_DEFAULT_S + 10)
    finally:
        await sender
        await layer.close_pools()

    assert received == {"type": "aggregator.step", "version": 3}
