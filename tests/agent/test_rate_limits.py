"""The volunteer's upload and download limits: the long-run rate stays under them, and every byte still arrives.

The bucket's clock and sleep are injected: the tests add up the waits it asks
for instead of timing anything.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crowdtrain_agent import fetch, ratelimit
from crowdtrain_agent.ratelimit import BURST_S, PIECE_BYTES, Limits, RateLimit


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@given(st.lists(st.integers(1, 1 << 20), min_size=1, max_size=40), st.floats(1e3, 1e7))
def test_the_waits_keep_the_long_run_rate_under_the_limit(sizes: list[int], rate: float) -> None:
    time = FakeTime()
    limit = RateLimit(rate, clock=time.clock, sleep=time.sleep)
    for size in sizes:
        limit.take(size)
    # With nothing but the transfers taking time, they take at least their bytes at the limit, less one burst.
    assert sum(time.slept) >= sum(sizes) / rate - BURST_S - 1e-9
    assert sum(time.slept) <= sum(sizes) / rate + 1e-6, "and no longer than that"


def test_a_transfer_slower_than_the_limit_never_waits() -> None:
    time = FakeTime()
    limit = RateLimit(1000.0, clock=time.clock, sleep=time.sleep)
    for _ in range(10):
        limit.take(200)  # each within the burst the limit allows
        time.now += 1.0  # the link itself takes a second per 200 bytes: a fifth of the limit
    assert time.slept == []


def test_a_limit_of_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match="above 0"):
        RateLimit(0)


class _Body(BaseHTTPRequestHandler):
    body = bytes(range(256)) * 1024  # 256 KiB

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Body)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/shard"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def limits() -> Iterator[FakeTime]:
    time = FakeTime()
    yield time
    Limits.set(download_kbps=None, upload_kbps=None)


def test_a_limited_download_arrives_whole_and_waits_its_bytes_at_the_limit(server: str, limits: FakeTime) -> None:
    Limits.download = RateLimit(64 << 10, clock=limits.clock, sleep=limits.sleep)  # 64 KiB/s

    body = fetch.http_get(server)
    into = memoryview(bytearray(len(_Body.body)))
    with fetch._open(server, token=None, timeout=fetch.HTTP_TIMEOUT_S) as response:  # read in place, as parameters are
        fetch._read_exactly_into(response, server, into)

    assert body == _Body.body and bytes(into) == _Body.body
    assert sum(limits.slept) == pytest.approx(2 * len(body) / (64 << 10) - BURST_S, abs=0.01)
    assert max(limits.slept) <= PIECE_BYTES / (64 << 10) + 1e-6, "paced piece by piece, not in one long wait"


def test_limits_are_set_from_kilobits_per_second_and_unset_by_none(limits: FakeTime) -> None:
    Limits.set(download_kbps=8000, upload_kbps=None)
    assert Limits.download is not None and Limits.download.bytes_per_s == 1_000_000 and Limits.upload is None


async def test_an_upload_limit_is_waited_on_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    monkeypatch.setattr(ratelimit.asyncio, "sleep", sleep)
    time = FakeTime()
    limit = RateLimit(1000.0, clock=time.clock)
    for _ in range(4):
        await limit.take_async(1000)
    # The clock does not move while the fake sleeps: each take waits for all the bytes taken before it.
    assert waits == pytest.approx([1.0 - BURST_S, 2.0 - BURST_S, 3.0 - BURST_S, 4.0 - BURST_S][: len(waits)])
