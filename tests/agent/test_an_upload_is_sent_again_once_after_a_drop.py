"""A slice whose connection dropped is sent once more; a refused ticket is not, and an absent aggregator is
tried twice, half a second apart, before the lease gives up."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from websockets.asyncio.server import ServerConnection, serve

from crowdtrain_agent.protocol import CloseCode, UploadBegin, UploadReceipt, encode_message
from crowdtrain_agent.uploader import Uploader, UploadError

BEGIN = UploadBegin(ticket="t", slice_index=0, codec="fp32", num_elements=0, num_chunks=0)


async def _aggregator(first: Callable[[ServerConnection], Awaitable[None]]) -> AsyncIterator[str]:
    """An aggregator that treats its first connection with ``first`` and answers every later one with a receipt."""
    seen = 0

    async def handle(ws: ServerConnection) -> None:
        nonlocal seen
        seen += 1
        async for _ in ws:
            if seen == 1:
                await first(ws)
                return
            await ws.send(encode_message(UploadReceipt(lease_id=1, slice_index=0, token="r")))

    async with serve(handle, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        yield f"ws://127.0.0.1:{port}/"


@pytest.fixture
async def dropping() -> AsyncIterator[str]:
    async def drop(ws: ServerConnection) -> None:
        await ws.close()

    async for url in _aggregator(drop):
        yield url


@pytest.fixture
async def refusing() -> AsyncIterator[str]:
    async def refuse(ws: ServerConnection) -> None:
        await ws.close(CloseCode.BAD_TICKET, "bad ticket")

    async for url in _aggregator(refuse):
        yield url


async def test_a_dropped_upload_is_sent_again_on_a_new_connection(dropping: str) -> None:
    uploader = Uploader(reply_timeout_s=5)

    receipt = await uploader.upload(dropping, BEGIN, [])

    assert receipt.token == "r" and uploader.connects == 2
    await uploader.close()


async def test_a_refused_ticket_is_not_sent_again(refusing: str) -> None:
    uploader = Uploader(reply_timeout_s=5)

    with pytest.raises(UploadError, match="bad ticket") as refused:
        await uploader.upload(refusing, BEGIN, [])

    assert refused.value.code == "closed" and uploader.connects == 1


async def test_an_absent_aggregator_is_tried_twice_then_given_up() -> None:
    uploader = Uploader(reply_timeout_s=5)
    started = time.monotonic()

    with pytest.raises(UploadError, match="cannot upload slice 0") as absent:
        await asyncio.wait_for(uploader.upload("ws://127.0.0.1:1/", BEGIN, []), 10)

    assert absent.value.code == "unreachable" and 0.5 <= time.monotonic() - started < 5
