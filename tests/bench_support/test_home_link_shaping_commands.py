"""The shaped home link's commands: loopback at a path MTU, and HTB classes the agent's address is filtered into."""

from __future__ import annotations

import pytest

from tests.benchmarks.shaping import DOWN_CLASS, OTHER_CLASS, UP_CLASS, HomeLink, shaping_commands


def _class_rate(commands: list[list[str]], classid: str) -> str:
    (command,) = [c for c in commands if c[:3] == ["tc", "class", "add"] and c[c.index("classid") + 1] == classid]
    return command[command.index("rate") + 1]


def _filter_class(commands: list[list[str]], direction: str, host: str) -> str:
    filters = [c for c in commands if c[:3] == ["tc", "filter", "add"]]
    (command,) = [c for c in filters if c[c.index("match") + 2 : c.index("match") + 4] == [direction, host]]
    return command[command.index("flowid") + 1]


def test_it_sets_the_loopback_mtu_before_it_shapes() -> None:
    commands = shaping_commands(HomeLink())

    assert commands[0] == ["ip", "link", "set", "lo", "mtu", "1500", "up"]
    assert all(c[0] == "tc" for c in commands[1:])


def test_it_gives_the_agents_upload_and_download_their_own_rates() -> None:
    commands = shaping_commands(HomeLink(up_mbit=20, down_mbit=100))

    assert _class_rate(commands, UP_CLASS) == "20000kbit"
    assert _class_rate(commands, DOWN_CLASS) == "100000kbit"
    assert _class_rate(commands, OTHER_CLASS) == "10gbit"


def test_it_files_packets_to_the_agents_address_as_upload_and_from_it_as_download() -> None:
    commands = shaping_commands(HomeLink(agent_host="127.0.0.9"))

    assert _filter_class(commands, "dst", "127.0.0.9/32") == UP_CLASS
    assert _filter_class(commands, "src", "127.0.0.9/32") == DOWN_CLASS


def test_everything_else_stays_unshaped() -> None:
    commands = shaping_commands(HomeLink())

    (qdisc,) = [c for c in commands if c[:2] == ["tc", "qdisc"]]
    assert qdisc[qdisc.index("default") + 1] == OTHER_CLASS.split(":")[1]


def test_it_refuses_a_link_without_bandwidth() -> None:
    with pytest.raises(ValueError, match="positive"):
        HomeLink(up_mbit=0)
