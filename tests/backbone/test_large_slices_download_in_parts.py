"""A large slice downloads in parts (HTTP Range), so an aggregator holds one part per download, not a slice.

websockets answers a plain HTTP request with a copy of its body, and the event
loop buffers what the socket does not take at once: at 100M parameters that
was 200 MB or more per downloading agent. The agent now asks for a slice
larger than ``fetch.PART_BYTES`` in parts of that size; here the size is
made small so that the test's slices take several.
"""

from __future__ import annotations

import asyncio
import mmap
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from crowdtrain_agent import fetch
from crowdtrain_agent.fetch import FetchError, HeldParams
from crowdtrain_agent.protocol import SliceRoute
from crowdtrain_backbone.server import BackboneServer

from .conftest import Agent, FakeSite, ticket
from .test_an_agent_rebuilds_a_version_from_the_one_it_holds import _fetch, _step
from .test_params_http import _get

PART = 1000  # bytes: two_slices's slice 0 is 4,000 bytes, 4 parts; its slice 1 is 2,952, 3 parts


@pytest.fixture
def parts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple[int, int] | None]]:
    """Small parts, and every request the agent makes: (URL, the byte range it asked for)."""
    monkeypatch.setattr(fetch, "PART_BYTES", PART)
    asked: list[tuple[str, tuple[int, int] | None]] = []
    opened = fetch._open

    def recording(url: str, **kwargs: Any) -> Any:
        asked.append((url, kwargs.get("part")))
        return opened(url, **kwargs)

    monkeypatch.setattr(fetch, "_open", recording)
    return asked


async def test_the_aggregator_answers_one_byte_range_and_serves_a_list_of_them_whole(
    two_slices: list[SliceRoute], backbone: BackboneServer
) -> None:
    url = f"{backbone.url}/params/1/0/0"
    _, _, whole = await _get(url)

    middle = await _get(url, {"Range": "bytes=100-1099"})
    tail = await _get(url, {"Range": "bytes=-10"})
    open_ended = await _get(url, {"Range": "bytes=3990-"})
    clipped = await _get(url, {"Range": "bytes=3000-99999"})
    past_the_end = await _get(url, {"Range": "bytes=4000-4100"})
    several = await _get(url, {"Range": "bytes=0-9,20-29"})
    backwards = await _get(url, {"Range": "bytes=5-3"})
    nothing_of_the_end = await _get(url, {"Range": "bytes=-0"})
    not_numbers = await _get(url, {"Range": "bytes=abc"})

    assert len(whole) == 4000
    assert middle[0] == 206 and middle[2] == whole[100:1100]
    assert middle[1]["Content-Range"] == "bytes 100-1099/4000" and middle[1]["X-Crowdtrain-Sha256"]
    assert tail[0] == 206 and tail[2] == whole[-10:] and tail[1]["Content-Range"] == "bytes 3990-3999/4000"
    assert open_ended[0] == 206 and open_ended[2] == whole[3990:]
    assert clipped[0] == 206 and clipped[2] == whole[3000:] and clipped[1]["Content-Range"] == "bytes 3000-3999/4000"
    assert past_the_end[0] == 416 and past_the_end[1]["Content-Range"] == "bytes */4000"
    assert several[0] == 200 and several[2] == whole and several[1]["Accept-Ranges"] == "bytes"
    assert backwards[0] == 200 and backwards[2] == whole  # an invalid range: the header is ignored
    assert nothing_of_the_end[0] == 416 and nothing_of_the_end[1]["Content-Range"] == "bytes */4000"
    assert not_numbers[0] == 200 and not_numbers[2] == whole


async def test_a_slice_larger_than_a_part_arrives_in_parts_equal_to_the_whole(
    site: FakeSite, two_slices: list[SliceRoute], agent: Agent, parts: list[tuple[str, tuple[int, int] | None]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    in_parts = await _fetch(two_slices, 0)
    asked = list(parts)
    parts.clear()
    monkeypatch.setattr(fetch, "PART_BYTES", 1 << 30)
    whole = await _fetch(two_slices, 0)

    assert torch.equal(in_parts.view(torch.int32), whole.view(torch.int32))
    assert [part for _, part in asked] == [
        (0, 999), (1000, 1999), (2000, 2999), (3000, 3999),  # slice 0: 4,000 bytes
        (0, 999), (1000, 1999), (2000, 2951),  # slice 1: 2,952 bytes
    ]  # fmt: skip
    assert [part for _, part in parts] == [None, None]


async def test_a_delta_larger_than_a_part_arrives_in_parts_and_rebuilds_the_version(
    site: FakeSite, two_slices: list[SliceRoute], agent: Agent, parts: list[tuple[str, tuple[int, int] | None]]
) -> None:
    held = HeldParams()
    await _fetch(two_slices, 0, held)
    await _step(site, agent, version=0, lease_id=1)
    parts.clear()

    rebuilt = await _fetch(two_slices, 1, held)

    assert torch.equal(rebuilt.view(torch.int32), (await _fetch(two_slices, 1)).view(torch.int32))
    deltas = [(url, part) for url, part in parts[:8] if "?from=0" in url]
    assert deltas and all(part is not None for _, part in deltas)  # the deltas too came in parts


async def test_a_version_republished_between_two_parts_fails_the_download_instead_of_mixing_them(
    site: FakeSite, two_slices: list[SliceRoute], agent: Agent, parts: list[tuple[str, tuple[int, int] | None]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    await _step(site, agent, version=0, lease_id=1)
    opened = fetch._open

    def other_publication_after_the_first_part(url: str, **kwargs: Any) -> Any:
        part = kwargs.get("part")
        if part is not None and part[0] > 0:  # the later parts come from version 0's bytes: another ETag
            url = url.replace("/params/1/0/1", "/params/1/0/0")
        return opened(url, **kwargs)

    monkeypatch.setattr(fetch, "_open", other_publication_after_the_first_part)

    with pytest.raises(FetchError, match="the version changed while it downloaded"):
        await asyncio.to_thread(fetch.fetch_slice, two_slices[0], 1, ticket=ticket(50, base_version=1))


@pytest.mark.parametrize("asked", [None, "bytes=0-"])
async def test_the_pages_a_download_read_are_let_go_once_it_is_sent(
    two_slices: list[SliceRoute], backbone: BackboneServer, asked: str | None
) -> None:
    # Without this, every page of a published version that the step's downloads read stayed resident to the
    # next step: a slice's worth of an aggregator's memory at any time.
    body = backbone.node.get_slice(1, 0).snapshots[0].body
    assert isinstance(body, mmap.mmap)
    body.madvise(mmap.MADV_DONTNEED)

    status, _, got = await _get(f"{backbone.url}/params/1/0/0", {"Range": asked} if asked else None)
    await asyncio.sleep(0.05)  # the loop's next turns, after the answer went out

    resident = _resident_kib(body)

    assert status in (200, 206) and got == body[:]
    assert resident == 0


def _resident_kib(pages: mmap.mmap) -> int:
    """The kernel's count of ``pages``'s resident memory in this process (its mapping's Rss in smaps)."""
    address = np.frombuffer(pages, dtype=np.uint8).ctypes.data
    rss = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            inside = int(span[1], 16) <= address < int(span[2], 16)
        elif inside and line.startswith("Rss:"):
            rss = int(line.split()[1])
    assert rss is not None, "the mapping is not in /proc/self/smaps"
    return rss
