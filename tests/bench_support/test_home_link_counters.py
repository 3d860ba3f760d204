"""The shaped link's byte counters: read from tc's statistics, and interpolated between samples."""

from __future__ import annotations

import pytest

from tests.benchmarks.shaping import LinkBytes, bytes_between, parse_class_bytes

TC_OUTPUT = """\
class htb 1:10 root prio 0 rate 20Mbit ceil 20Mbit burst 1600b cburst 1600b
 Sent 5235892 bytes 3574 pkt (dropped 0, overlimits 268 requeues 0)
 backlog 0b 0p requeues 0
 lended: 3574 borrowed: 0 giants: 0
 tokens: 10000 ctokens: 10000

class htb 1:20 root prio 0 rate 100Mbit ceil 100Mbit burst 1600b cburst 1600b
 Sent 5245594 bytes 3721 pkt (dropped 0, overlimits 116 requeues 0)
 backlog 0b 0p requeues 0

class htb 1:30 root prio 0 rate 10Gbit ceil 10Gbit burst 0b cburst 0b
 Sent 0 bytes 0 pkt (dropped 0, overlimits 0 requeues 0)
"""


def test_it_reads_the_bytes_each_class_sent() -> None:
    assert parse_class_bytes(TC_OUTPUT) == {"1:10": 5235892, "1:20": 5245594, "1:30": 0}


def test_it_interpolates_the_bytes_between_two_moments() -> None:
    series = [LinkBytes(10.0, 0, 0), LinkBytes(12.0, 2000, 10000), LinkBytes(14.0, 2000, 30000)]

    up, down = bytes_between(series, 11.0, 13.0)

    assert up == pytest.approx(1000.0)
    assert down == pytest.approx(20000.0 - 5000.0)


def test_it_takes_a_sample_at_the_very_moment_as_it_is() -> None:
    series = [LinkBytes(10.0, 100, 200), LinkBytes(12.0, 300, 600)]

    assert bytes_between(series, 10.0, 12.0) == (200.0, 400.0)


def test_it_refuses_a_window_the_samples_do_not_cover() -> None:
    series = [LinkBytes(10.0, 0, 0), LinkBytes(12.0, 1, 1)]

    with pytest.raises(ValueError, match="cover"):
        bytes_between(series, 9.0, 11.0)
