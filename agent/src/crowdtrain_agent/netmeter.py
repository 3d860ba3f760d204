"""How the volunteer's link is doing: upload and download rates, and the share of time spent waiting on it.

A volunteer whose agent is slow wants to know whether to blame the GPU or the
home uplink. Bytes are counted where they cross the network (the uploader's
frames, parameter and shard downloads), and the run loop reports the time its
compute thread sat idle waiting for a download to finish or for the previous
upload to make room: that idle time over the time spent working is the
network's share.

One meter per process (``METER``), as prometheus_client has one registry: an
agent process runs one agent, and counting at the socket edge needs no meter
handed through every download helper.

Each done report also states what its lease cost the link (``LeaseCost``, the
2.3 fields of ``LeaseDone``), so the campaign page can show bytes per sample
and the network's share of the swarm's time. Uploads are counted per lease
exactly; downloads and waits are not tied to one lease (the next lease's
parameters download while this one computes, shards are fetched ahead), so a
report is charged whatever came down and was waited for since the report
before it (``NetworkMeter.unreported``). Summed over a run, every byte and
second is reported once.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

WINDOW_S = 30.0  # the rates are averages over this much recent time: steady, yet they follow a change


@dataclass
class LeaseCost:
    """What one lease cost the agent's link, as its done report states it.

    ``bytes_up`` is counted by the uploader for this lease's slices alone (the
    gradient frames, chunk headers and a resend included); ``bytes_down`` and
    ``network_s`` are the meter's figures since the previous report.
    """

    bytes_up: int = 0
    bytes_down: int = 0
    network_s: float = 0.0


@dataclass(frozen=True)
class NetworkFigures:
    up_bytes_per_s: float
    down_bytes_per_s: float
    wait_share: float | None  # None until the agent has worked a moment
    bytes_up: int
    bytes_down: int


class NetworkMeter:
    """Thread-safe byte counts over a sliding window, and the time waited on transfers."""

    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._up: deque[tuple[float, int]] = deque()
        self._down: deque[tuple[float, int]] = deque()
        self.bytes_up = 0
        self.bytes_down = 0
        self.waited_s = 0.0
        self._working_since: float | None = None
        self._reported_down = 0  # bytes_down and waited_s as the last done report took them
        self._reported_waited = 0.0

    def sent(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_up += nbytes
            self._up.append((self._clock(), nbytes))

    def received(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_down += nbytes
            self._down.append((self._clock(), nbytes))

    def start_working(self) -> None:
        """The run loop starts: the wait share counts from here."""
        with self._lock:
            if self._working_since is None:
                self._working_since = self._clock()

    def waited(self, seconds: float) -> None:
        """The compute thread sat idle this long for a transfer (a download, or the previous upload)."""
        if seconds > 0:
            with self._lock:
                self.waited_s += seconds

    def unreported(self) -> tuple[int, float]:
        """Bytes received and seconds waited since the last call, which the caller's done report states.

        Returns:
            ``(bytes_down, network_s)``: the next report's share; the call marks them reported.
        """
        with self._lock:
            down = self.bytes_down - self._reported_down
            waited = self.waited_s - self._reported_waited
            self._reported_down, self._reported_waited = self.bytes_down, self.waited_s
            return down, max(0.0, waited)

    def _rate(self, events: deque[tuple[float, int]], now: float) -> float:
        while events and events[0][0] < now - self.window_s:
            events.popleft()
        if not events:
            return 0.0
        # Over the window, or since the first transfer when the agent is younger than the window.
        span = min(self.window_s, max(now - events[0][0], 1.0))
        return sum(n for _, n in events) / span

    def figures(self) -> NetworkFigures:
        with self._lock:
            now = self._clock()
            since = self._working_since
            elapsed = now - since if since is not None else 0.0
            return NetworkFigures(
                up_bytes_per_s=self._rate(self._up, now),
                down_bytes_per_s=self._rate(self._down, now),
                wait_share=min(1.0, self.waited_s / elapsed) if elapsed >= 1.0 else None,
                bytes_up=self.bytes_up,
                bytes_down=self.bytes_down,
            )


def rate_text(bytes_per_s: float) -> str:
    """A link speed as people quote them: megabits per second (home uplinks are sold that way)."""
    return f"{bytes_per_s * 8 / 1e6:.1f} Mbit/s"


def describe(figures: NetworkFigures) -> str:
    """The agent panel's network line: rates, and how much of the time the link kept the compute waiting."""
    line = f"up {rate_text(figures.up_bytes_per_s)}, down {rate_text(figures.down_bytes_per_s)}"
    if figures.wait_share is not None:
        line += f"; waited on the network {figures.wait_share:.0%} of the time"
    return line


METER = NetworkMeter()
