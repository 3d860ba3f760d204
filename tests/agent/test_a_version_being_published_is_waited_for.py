"""A parameter download answered 404 (the version is being published there) is tried again, from 50 ms
doubling to 1 s, until the next pause would pass its time; any other failure is reported at once."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from crowdtrain_agent.fetch import FetchError, HttpStatusError, _retrying
from crowdtrain_agent.protocol import SliceRoute

ROUTE = SliceRoute(index=0, start=0, end=4, upload_url="ws://unused", params_url="http://unused/")


def _answers(*codes: int) -> tuple[Callable[[], str], list[float]]:
    """An attempt that fails with these HTTP statuses in turn, then succeeds; and when it was called."""
    left, calls = list(codes), []

    def attempt() -> str:
        calls.append(time.monotonic())
        if left:
            code = left.pop(0)
            raise HttpStatusError(f"HTTP {code}", code)
        return "etag"

    return attempt, calls


def test_a_404_is_tried_again_with_growing_pauses() -> None:
    attempt, calls = _answers(404, 404, 404)

    assert _retrying(ROUTE, 3, "http://unused/3", attempt, retry_for_s=5.0) == "etag"

    pauses = [later - earlier for earlier, later in zip(calls, calls[1:], strict=False)]
    assert len(calls) == 4 and pauses[0] >= 0.05 and pauses[1] >= 0.1 and pauses[2] >= 0.2


def test_another_status_is_reported_at_once() -> None:
    attempt, calls = _answers(500)

    with pytest.raises(FetchError, match="parameters of version 3, slice 0: HTTP 500 from http://unused/3"):
        _retrying(ROUTE, 3, "http://unused/3", attempt, retry_for_s=5.0)

    assert len(calls) == 1


def test_a_version_never_published_in_time_is_given_up() -> None:
    attempt, calls = _answers(*[404] * 100)
    started = time.monotonic()

    with pytest.raises(FetchError, match="HTTP 404"):
        _retrying(ROUTE, 3, "http://unused/3", attempt, retry_for_s=0.3)

    assert 0.1 <= time.monotonic() - started < 1.0 and 2 <= len(calls) <= 4
