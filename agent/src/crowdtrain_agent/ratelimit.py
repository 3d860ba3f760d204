"""The volunteer's upload and download rate limits: a token bucket each, shared by every transfer of the agent.

A volunteer whose video call stutters while the agent uploads sets a limit
(``--upload-kbps``) instead of uninstalling it. Downloads run in threads and
uploads on the event loop, so a bucket can be waited on from either; its clock
and sleep are injectable, so tests count the waits instead of timing them.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

# How far (in seconds at the limit) a transfer may run ahead: short bursts are free, the long-run rate bounded.
BURST_S = 0.25
# A limited read asks for at most this much at once, so the bucket is consulted often enough to pace it.
PIECE_BYTES = 64 << 10


class RateLimit:
    """At most ``bytes_per_s`` over time, across every caller."""

    def __init__(
        self,
        bytes_per_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not bytes_per_s > 0:
            raise ValueError(f"a rate limit must be above 0 bytes/s, got {bytes_per_s}")
        self.bytes_per_s = bytes_per_s
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._free_at = clock()  # when the bytes taken so far will have been sent at the limit

    def _delay(self, nbytes: int) -> float:
        with self._lock:
            now = self._clock()
            self._free_at = max(self._free_at, now) + nbytes / self.bytes_per_s
            return max(0.0, self._free_at - now - BURST_S)

    def take(self, nbytes: int) -> None:
        """Wait (in this thread) until ``nbytes`` more fit the limit."""
        delay = self._delay(nbytes)
        if delay > 0:
            self._sleep(delay)

    async def take_async(self, nbytes: int) -> None:
        """``take`` for the event loop."""
        delay = self._delay(nbytes)
        if delay > 0:
            await asyncio.sleep(delay)


class Limits:
    """The agent's two limits (None: unlimited); set once at start-up from its config."""

    download: RateLimit | None = None
    upload: RateLimit | None = None

    @classmethod
    def set(cls, *, download_kbps: float | None, upload_kbps: float | None) -> None:
        cls.download = RateLimit(download_kbps * 125) if download_kbps else None  # kbit/s -> bytes/s
        cls.upload = RateLimit(upload_kbps * 125) if upload_kbps else None


class LimitedResponse:
    """An HTTP response whose reads wait for the download limit; everything else is the response's."""

    def __init__(self, response: Any, limit: RateLimit) -> None:
        self._response, self._limit = response, limit

    def __getattr__(self, name: str) -> Any:
        return getattr(self._response, name)

    def __enter__(self) -> LimitedResponse:
        self._response.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._response.__exit__(*exc)

    def readinto(self, out: memoryview) -> int:
        count = int(self._response.readinto(out[:PIECE_BYTES]))
        self._limit.take(count)
        return count

    def read(self, size: int = -1) -> bytes:
        parts: list[bytes] = []
        got = 0
        while size < 0 or got < size:
            want = PIECE_BYTES if size < 0 else min(PIECE_BYTES, size - got)
            data = bytes(self._response.read(want))
            if not data:
                break
            self._limit.take(len(data))
            parts.append(data)
            got += len(data)
        return b"".join(parts)
