"""A shaped home link on loopback: HTB classes for one address's upload and download, and a check that they hold.

Run inside a private network namespace (``unshare -n``, as root): the
commands change that namespace's ``lo`` only. The agent reaches the site and
the aggregator at ``AGENT_HOST`` (127.0.0.2), everyone else uses 127.0.0.1,
so u32 filters on that one address pick out exactly the agent's traffic:

- packets *to* 127.0.0.2 are what the agent sends (its upload, and its ACKs
  of downloads, as on a real uplink): class 1:10, 20 Mbit/s by default;
- packets *from* 127.0.0.2 are what the servers send it (its download):
  class 1:20, 100 Mbit/s by default;
- everything else (site to aggregator, this process to the site) stays at
  loopback speed in class 1:30, as it would inside a data centre.

Loopback has one qdisc and every packet leaves through it exactly once, so
each direction is shaped once. Filtering by address instead of by port keeps
the site's own connection to the aggregator out of the agent's classes,
which a port filter cannot tell apart from the agent's.

``tc`` runs through subprocess rather than pyroute2: eight fixed commands
that a reader can paste into a shell, nothing to install, and a failure
comes back as tc's own message.
"""

from __future__ import annotations

import bisect
import logging
import re
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

AGENT_HOST = "127.0.0.2"  # the agent's address for the site and the aggregator: only its traffic is shaped
SERVER_HOST = "127.0.0.1"
UP_CLASS, DOWN_CLASS, OTHER_CLASS = "1:10", "1:20", "1:30"
# A real path's MTU. With loopback's 64 KiB, a shaper whose burst is smaller than one packet (TBF's
# is) drops every full-size packet, and the agent's shard download times out: no product bug.
PATH_MTU = 1500
# One full-size frame: HTB's default quantum at these rates is far above it and tc warns on every class.
QUANTUM_BYTES = 1514
UNSHAPED_RATE = "10gbit"

# Measured goodput over the configured rate: HTB counts headers (66 of each 1514-byte frame), so a
# working shaper gives about 0.95 of the rate in payload. Outside these bounds the link is not the one
# configured (no shaping at all shows as many times the rate).
LINK_RATIO_MIN, LINK_RATIO_MAX = 0.8, 1.05


class ShapingError(RuntimeError):
    """A command that sets up the shaped link failed; the message is the command and its stderr."""


@dataclass(frozen=True)
class HomeLink:
    """A volunteer's home connection: upload and download rates in Mbit/s."""

    up_mbit: float = 20.0
    down_mbit: float = 100.0
    agent_host: str = AGENT_HOST
    mtu: int = PATH_MTU

    def __post_init__(self) -> None:
        if self.up_mbit <= 0 or self.down_mbit <= 0:
            raise ValueError(f"link rates must be positive, got up {self.up_mbit} and down {self.down_mbit} Mbit/s")


def _kbit(mbit: float) -> str:
    return f"{round(mbit * 1000)}kbit"  # whole kbit/s: tc reads "20.5mbit" too, but not every iproute2 does


def shaping_commands(link: HomeLink) -> list[list[str]]:
    """The ``ip`` and ``tc`` commands that shape ``lo`` of the current namespace, in order."""
    lo = ["dev", "lo"]

    def htb_class(classid: str, rate: str) -> list[str]:
        return ["tc", "class", "add", *lo, "parent", "1:", "classid", classid, "htb",
                "rate", rate, "ceil", rate, "quantum", str(QUANTUM_BYTES)]  # fmt: skip

    def u32_filter(prio: int, direction: str, classid: str) -> list[str]:
        return ["tc", "filter", "add", *lo, "parent", "1:", "protocol", "ip", "prio", str(prio),
                "u32", "match", "ip", direction, f"{link.agent_host}/32", "flowid", classid]  # fmt: skip

    return [
        ["ip", "link", "set", "lo", "mtu", str(link.mtu), "up"],
        ["tc", "qdisc", "replace", *lo, "root", "handle", "1:", "htb", "default", OTHER_CLASS.split(":")[1]],
        htb_class(UP_CLASS, _kbit(link.up_mbit)),
        htb_class(DOWN_CLASS, _kbit(link.down_mbit)),
        htb_class(OTHER_CLASS, UNSHAPED_RATE),
        u32_filter(1, "dst", UP_CLASS),
        u32_filter(2, "src", DOWN_CLASS),
    ]


def apply_shaping(link: HomeLink) -> None:
    """Run ``shaping_commands``.

    Raises:
        ShapingError: naming the command that failed and what it printed (no HTB in the kernel, no root...).
    """
    for argv in shaping_commands(link):
        try:
            result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        except FileNotFoundError:
            raise ShapingError(f"{argv[0]} is not installed (Debian: apt-get install iproute2)") from None
        if result.returncode != 0:
            said = (result.stderr or result.stdout).strip().replace("\n", " ")
            raise ShapingError(f"`{' '.join(argv)}` failed ({result.returncode}): {said}")


# ------------------------------------------------------------------ counters

_CLASS_SENT = re.compile(r"class htb (\d+:\d+)\b.*?\n\s*Sent (\d+) bytes", re.DOTALL)


def parse_class_bytes(text: str) -> dict[str, int]:
    """Bytes sent per HTB class, from ``tc -s class show``: ``{"1:10": 5235892, ...}``."""
    return {classid: int(sent) for classid, sent in _CLASS_SENT.findall(text)}


@dataclass(frozen=True)
class LinkBytes:
    """The shaped classes' byte counters at one moment (wall clock, as the site's commit times)."""

    at: float
    up: int
    down: int


def read_link_bytes() -> LinkBytes:
    """The agent's bytes so far, each way, as the kernel counted them on the wire (headers included)."""
    out = subprocess.run(["tc", "-s", "class", "show", "dev", "lo"], capture_output=True, text=True, check=True)
    sent = parse_class_bytes(out.stdout)
    return LinkBytes(time.time(), sent.get(UP_CLASS, 0), sent.get(DOWN_CLASS, 0))


def bytes_between(series: Sequence[LinkBytes], start: float, end: float) -> tuple[float, float]:
    """Up and down bytes between two moments, linearly interpolated between the samples around each.

    Raises:
        ValueError: if the series does not cover ``[start, end]``.
    """
    if not series or start < series[0].at or end > series[-1].at or end < start:
        covered = f"{series[0].at:.2f}..{series[-1].at:.2f}" if series else "nothing"
        raise ValueError(f"counter samples cover {covered}, not {start:.2f}..{end:.2f}")
    times = [s.at for s in series]

    def at(moment: float) -> tuple[float, float]:
        i = bisect.bisect_left(times, moment)
        if times[i] == moment:
            return float(series[i].up), float(series[i].down)
        a, b = series[i - 1], series[i]
        w = (moment - a.at) / (b.at - a.at)
        return a.up + w * (b.up - a.up), a.down + w * (b.down - a.down)

    (up0, down0), (up1, down1) = at(start), at(end)
    return up1 - up0, down1 - down0


# ------------------------------------------------------------------ link check


@dataclass(frozen=True)
class LinkRates:
    """Payload rates a bulk TCP transfer reached each way, in Mbit/s."""

    up_mbit: float
    down_mbit: float


def measure_link(link: HomeLink, *, up_bytes: int = 2_500_000, down_bytes: int = 6_000_000) -> LinkRates:
    """Send ``up_bytes`` as the agent would, receive ``down_bytes``; time each at its receiving end.

    About a second each way at the default rates. The receiver's clock runs from
    its first byte to its last, so socket buffers filling at loopback speed on
    the sender's side do not flatter the figure.
    """
    server = socket.create_server(("0.0.0.0", 0))  # noqa: S104 (a private namespace: nothing else can reach it)
    port = server.getsockname()[1]
    up_s: list[float] = []

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            up_s.append(_receive(conn, up_bytes))
            conn.sendall(b"\0" * down_bytes)

    thread = threading.Thread(target=serve, name="link-check", daemon=True)
    thread.start()
    try:
        with socket.create_connection((link.agent_host, port), timeout=60) as client:
            client.sendall(b"\0" * up_bytes)
            down_s = _receive(client, down_bytes)
        thread.join(60)
    finally:
        server.close()
    return LinkRates(up_mbit=up_bytes * 8 / up_s[0] / 1e6, down_mbit=down_bytes * 8 / down_s / 1e6)


def _receive(conn: socket.socket, nbytes: int) -> float:
    """Read exactly ``nbytes``; seconds from the first byte to the last."""
    got, first = 0, 0.0
    while got < nbytes:
        chunk = conn.recv(1 << 20)
        if not chunk:
            raise ConnectionError(f"link check: the peer closed after {got} of {nbytes} bytes")
        if not got:
            first = time.perf_counter()
        got += len(chunk)
    return max(time.perf_counter() - first, 1e-9)


def link_problem(measured: LinkRates, link: HomeLink) -> str | None:
    """Why the measured rates show the link is not the one configured, or None when both are within bounds."""
    problems = []
    for way, got, want in (("up", measured.up_mbit, link.up_mbit), ("down", measured.down_mbit, link.down_mbit)):
        ratio = got / want
        if not LINK_RATIO_MIN <= ratio <= LINK_RATIO_MAX:
            problems.append(f"{way} {got:.1f} Mbit/s for a {want:g} Mbit/s class ({ratio:.2f} of it)")
    if not problems:
        return None
    return "the shaped link does not hold: " + ", ".join(problems)
