"""The data channel: gradient slices to the aggregators that own them, one reused connection per aggregator."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake
from websockets.typing import Subprotocol

from .netmeter import METER, LeaseCost
from .protocol import (
    AGGREGATOR_TO_AGENT,
    MAX_WS_MESSAGE_BYTES,
    CloseCode,
    ErrorMessage,
    ProtocolError,
    UploadBegin,
    UploadReceipt,
    UploadRejected,
    decode_message,
    encode_message,
    negotiated_minor,
    offered_subprotocols,
)
from .ratelimit import Limits

logger = logging.getLogger(__name__)

UPLOAD_WRITE_LIMIT_BYTES = 8 << 20  # buffered before send() waits: a few MiB slice in one go


def _ignore_newer_fields(kind: str, fields: list[str]) -> None:
    logger.debug("a newer aggregator's %s carries fields this agent does not know: %s", kind, ", ".join(fields))


def _worth_resending(exc: BaseException) -> bool:
    """A dropped or unreachable connection is tried once more; a refused ticket never is."""
    if isinstance(exc, ConnectionClosed):
        return exc.rcvd is None or exc.rcvd.code != CloseCode.BAD_TICKET
    return isinstance(exc, (OSError, TimeoutError, InvalidHandshake))


def _pause_before_resending(state: RetryCallState) -> float:
    """At once after a drop (the aggregator is there); half a second when it could not be reached."""
    failed = state.outcome.exception() if state.outcome is not None else None
    return 0.0 if isinstance(failed, ConnectionClosed) else 0.5


class UploadError(RuntimeError):
    """A slice the aggregator did not accept; the lease cannot be reported as done."""

    def __init__(self, message: str, *, code: str = "") -> None:
        super().__init__(message)
        self.code = code


class Uploader:
    """Sends slices over one WebSocket per aggregator URL, kept open between leases.

    Uploads to the same aggregator are serialized (a receipt answers the
    upload before it); uploads to different aggregators run concurrently.

    Args:
        reply_timeout_s: how long to wait for a receipt after the last chunk.
    """

    def __init__(self, *, reply_timeout_s: float = 60.0) -> None:
        self._reply_timeout_s = reply_timeout_s
        self._connections: dict[str, ClientConnection] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.connects = 0

    async def upload(
        self,
        url: str,
        begin: UploadBegin,
        chunks: Sequence[tuple[bytes, memoryview]],
        *,
        cost: LeaseCost | None = None,
    ) -> UploadReceipt:
        """Send one slice (header, then its binary chunks) and wait for the aggregator's answer.

        Chunks are ``chunk_fragments`` pairs, each sent as two fragments of one
        message, so the payload is not copied first.

        A connection that dropped is reopened once and the slice sent again.

        Args:
            cost: the lease's tally: every chunk byte sent is added to its ``bytes_up``, a resend too.

        Raises:
            UploadError: if the aggregator rejected the slice, closed on it, or cannot be reached.
        """
        lock = self._locks.setdefault(url, asyncio.Lock())
        async with lock:
            resending = AsyncRetrying(
                retry=retry_if_exception(_worth_resending),
                wait=_pause_before_resending,
                stop=stop_after_attempt(2),
                before_sleep=lambda state: logger.debug(
                    "aggregator %s: %s; sending slice %d again",
                    url,
                    state.outcome.exception() if state.outcome is not None else "connection lost",
                    begin.slice_index,
                ),
                reraise=True,
            )
            try:
                raw: str | bytes = await resending(self._send_once, url, begin, chunks, cost)
            except ConnectionClosed as exc:
                code = exc.rcvd.code if exc.rcvd is not None else None
                reason = exc.rcvd.reason if exc.rcvd is not None else "connection dropped"
                raise UploadError(
                    f"aggregator {url} closed the upload of slice {begin.slice_index} (code {code}: {reason})",
                    code="closed",
                ) from None
            except (OSError, TimeoutError, InvalidHandshake) as exc:
                raise UploadError(
                    f"cannot upload slice {begin.slice_index} to {url}: {exc}", code="unreachable"
                ) from None
            return self._check_reply(url, begin, raw)

    async def _send_once(
        self, url: str, begin: UploadBegin, chunks: Sequence[tuple[bytes, memoryview]], cost: LeaseCost | None
    ) -> str | bytes:
        """One try at sending a slice; returns the aggregator's raw answer. A failed connection is forgotten."""
        try:
            ws = await self._connection(url)
            await ws.send(encode_message(begin, negotiated_minor(ws.subprotocol)))
            for chunk in chunks:
                await ws.send(list(chunk))
                sent = sum(len(part) for part in chunk)
                METER.sent(sent)
                if Limits.upload is not None:  # the volunteer's upload limit (``--upload-kbps``)
                    await Limits.upload.take_async(sent)
                if cost is not None:
                    cost.bytes_up += sent
            return await asyncio.wait_for(ws.recv(), self._reply_timeout_s)
        except (ConnectionClosed, OSError, TimeoutError, InvalidHandshake):
            self._connections.pop(url, None)
            raise

    def _check_reply(self, url: str, begin: UploadBegin, raw: str | bytes) -> UploadReceipt:
        try:
            reply = decode_message(raw, allowed=AGGREGATOR_TO_AGENT, unknown=_ignore_newer_fields)
        except ProtocolError as exc:
            raise UploadError(
                f"aggregator {url} answered slice {begin.slice_index} with a bad message: {exc}"
            ) from None
        if isinstance(reply, UploadReceipt):
            if reply.slice_index != begin.slice_index:
                raise UploadError(
                    f"aggregator {url} sent a receipt for slice {reply.slice_index} after slice {begin.slice_index}"
                )
            return reply
        if isinstance(reply, UploadRejected):
            verb = "rejected"
        elif isinstance(reply, ErrorMessage):  # the aggregator could not even parse what we sent
            verb = "refused"
        else:
            raise UploadError(f"aggregator {url} answered slice {begin.slice_index} with {reply.kind!r}, not a receipt")
        raise UploadError(
            f"aggregator {url} {verb} slice {begin.slice_index}: {reply.code} ({reply.detail})", code=reply.code
        )

    async def _connection(self, url: str) -> ClientConnection:
        ws = self._connections.get(url)
        if ws is None:
            # Replies are small; outgoing chunks are kept under the limit by split_payload. A slice's
            # chunks go to the kernel without waiting for the aggregator to drain each one (the default
            # 32 KiB write limit meant a context switch per chunk), and gradients do not compress.
            ws = await connect(
                url,
                max_size=MAX_WS_MESSAGE_BYTES,
                open_timeout=10,
                compression=None,
                write_limit=UPLOAD_WRITE_LIMIT_BYTES,
                subprotocols=[Subprotocol(p) for p in offered_subprotocols()],
            )
            self._connections[url] = ws
            self.connects += 1
        return ws

    async def close(self) -> None:
        """Close every aggregator connection."""
        connections, self._connections = list(self._connections.values()), {}
        for ws in connections:
            try:
                await ws.close()
            except Exception:  # closing a dead socket must not hide the reason we are stopping
                logger.debug("error closing an aggregator connection", exc_info=True)
