"""The volunteer's controls: when the agent may work, read from flags, variables or a file, and obeyed at once.

The clock, the idle time and the battery are injected (``controls.Signals``);
the agent runs whole against the fake site and aggregators.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crowdtrain_agent import runtime, trainer
from crowdtrain_agent.config import AgentConfig, ConfigError, load_config
from crowdtrain_agent.controls import ControlError, Controls, Gate, Signals, Window, parse_schedule
from crowdtrain_agent.protocol import ControlsChanged, DeviceControls, LeaseDone, LeaseRelease, LeaseRequest, Paused
from crowdtrain_agent.runtime import Agent

from .conftest import FAST_BACKOFF
from .fakes import World

MONDAY_NOON = datetime(2026, 11, 30, 12, 0)
MONDAY_EVENING = datetime(2026, 11, 30, 19, 30)


# ------------------------------------------------------------------ the schedule


def test_a_schedule_reads_days_hours_and_windows_past_midnight() -> None:
    (weekdays, weekend) = parse_schedule("mon-fri 18:00-08:00; sat,sun 00:00-24:00")
    assert weekdays.allows(MONDAY_EVENING) and not weekdays.allows(MONDAY_NOON)
    assert weekdays.allows(datetime(2026, 12, 1, 7, 59)), "Tuesday's small hours belong to Monday evening's window"
    assert not weekdays.allows(datetime(2026, 11, 30, 7, 0)), "Monday's small hours belong to Sunday, not listed"
    assert weekend.allows(datetime(2026, 12, 5, 23, 59)) and not weekend.allows(MONDAY_EVENING)
    assert parse_schedule("fri-mon 09:00-17:00")[0].days == frozenset({4, 5, 6, 0}), "a range may wrap the week"
    assert parse_schedule("22:00-06:00")[0].days == frozenset(range(7)), "no days: every day"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("mon-fri 18-08", "is not 'DAYS HH:MM-HH:MM'"),
        ("mon-fry 18:00-20:00", "unknown day"),
        ("mon 25:00-26:00", "is not between 00:00 and 24:00"),
        ("mon 10:00-10:00", "is empty"),
    ],
)
def test_a_schedule_that_means_nothing_is_refused_with_what_to_write(text: str, says: str) -> None:
    with pytest.raises(ControlError, match=says):
        parse_schedule(text)


@given(
    st.integers(0, 1439), st.integers(0, 1440), st.sets(st.integers(0, 6), min_size=1), st.integers(0, 6),
    st.integers(0, 1439),
)  # fmt: skip
def test_a_window_allows_exactly_its_minutes(start: int, end: int, days: set[int], day: int, minute: int) -> None:
    if start == end:
        return
    window = Window(frozenset(days), start, end)
    when = MONDAY_NOON.replace(hour=0) + timedelta(days=day, minutes=minute)
    weekday = when.weekday()
    if start < end:
        expected = weekday in days and start <= minute < end
    else:
        expected = (weekday in days and minute >= start) or ((weekday - 1) % 7 in days and minute < end)
    assert window.allows(when) == expected


# ------------------------------------------------------------------ the gate


def _gate(controls: Controls, **readings: Any) -> Gate:
    signals = Signals(
        now=lambda: readings.get("now", MONDAY_NOON),
        input_idle_s=lambda: readings.get("idle"),
        other_cpu=lambda: readings.get("cpu"),
        on_battery=lambda: readings.get("battery"),
    )
    return Gate(controls, signals)


def test_each_control_says_why_it_stops_work() -> None:
    assert _gate(Controls(schedule=parse_schedule("mon 18:00-20:00"))).why_not() == "outside your schedule"
    assert _gate(Controls(pause_on_battery=True), battery=True).why_not() == "on battery"
    assert _gate(Controls(pause_on_battery=True), battery=False).why_not() == ""
    busy = _gate(Controls(idle_after_min=5), idle=42.0).why_not()
    assert busy.startswith("the computer is in use (input 42 s ago")
    assert _gate(Controls(idle_after_min=5), idle=301.0).why_not() == ""
    assert _gate(Controls(max_other_cpu=0.5), cpu=0.8).why_not() == "other programs use 80% of the CPUs (over your 50%)"


def test_a_reading_this_system_cannot_give_is_said_once_and_stops_nothing(caplog: pytest.LogCaptureFixture) -> None:
    gate = _gate(Controls(idle_after_min=5, pause_on_battery=True))
    with caplog.at_level(logging.WARNING, logger="crowdtrain_agent.controls"):
        assert [gate.why_not() for _ in range(3)] == ["", "", ""]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and any("idle_after_min control is ignored" in s for s in said), said


# ------------------------------------------------------------------ where they come from


def test_controls_come_from_flags_then_variables_then_the_controls_file(tmp_path: Path) -> None:
    path = tmp_path / "controls.json"
    path.write_text(json.dumps({"idle_minutes": 10, "schedule": "sat,sun 00:00-24:00", "upload_kbps": 512,
                                "gpus": "1", "pause_on_battery": True}))  # fmt: skip
    flags = {"server": "http://site", "token": "t", "idle_minutes": "3", "controls_file": str(path)}
    env = {"CROWDTRAIN_AGENT_SCHEDULE": "mon-fri 18:00-08:00"}

    config = load_config(flags, env, config_path=tmp_path / "none.json")

    assert config.controls.idle_after_min == 3.0  # the flag
    assert config.controls.schedule == parse_schedule("mon-fri 18:00-08:00")  # the variable
    assert config.controls.pause_on_battery and config.upload_kbps == 512 and config.gpus == (1,)  # the file


@pytest.mark.parametrize(
    ("flags", "file", "says"),
    [
        ({"idle_minutes": "soon"}, None, "--idle-minutes must be a number from 0 to 1440"),
        ({"max_other_cpu": "150"}, None, "--max-other-cpu must be a number from 1 to 100"),
        ({"gpus": "0,x"}, None, "--gpus must be GPU indices"),
        ({"schedule": "weekends"}, None, "schedule part 'weekends'"),
        ({}, {"idle_mins": 5}, r"unknown keys \['idle_mins'\]"),
        ({}, {"pause_on_battery": "perhaps"}, "pause_on_battery in .* must be true or false"),
    ],
)
def test_a_control_that_cannot_be_read_is_refused_by_name(
    tmp_path: Path, flags: dict[str, Any], file: dict[str, Any] | None, says: str
) -> None:
    path = tmp_path / "controls.json"
    if file is not None:
        path.write_text(json.dumps(file))
    with pytest.raises(ConfigError, match=says):
        load_config({"server": "http://site", "token": "t", "controls_file": str(path), **flags}, {}, tmp_path / "x")


# ------------------------------------------------------------------ the agent obeys


class Readings:
    """Signals a test changes while the agent runs."""

    def __init__(self) -> None:
        self.now = MONDAY_NOON
        self.battery = False

    def signals(self) -> Signals:
        return Signals(now=lambda: self.now, on_battery=lambda: self.battery)


async def _until(condition: Any, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


@pytest.fixture
def quick_controls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime, "CONTROL_CHECK_S", 0.05)


@pytest.fixture
def long_leases(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Leases that compute until cancelled (as between two microbatches); the event is set once one starts."""
    started = threading.Event()
    honest = trainer.compute_gradient

    def long_compute(*args: Any, cancel: threading.Event | None = None, **kwargs: Any) -> Any:
        started.set()
        assert cancel is not None
        if cancel.wait(20):
            raise trainer.ComputeCancelled("cancelled between microbatches")
        return honest(*args, cancel=cancel, **kwargs)

    monkeypatch.setattr(trainer, "compute_gradient", long_compute)
    return started


async def test_outside_its_schedule_it_asks_for_nothing_says_why_and_starts_when_the_window_opens(
    world: World, config: AgentConfig, quick_controls: None
) -> None:
    readings = Readings()
    world.site.negotiates = True  # a site of 2.8, which hears of pauses
    config = replace(config, max_leases=1, controls=Controls(schedule=parse_schedule("mon-fri 18:00-08:00")))
    world.site.replies = [world.lease(1, [(0, 8)])]
    agent = Agent(config, backoff=FAST_BACKOFF, benchmark_s=0.01, signals=readings.signals())
    running = asyncio.create_task(agent.run())

    await _until(lambda: world.site.of_kind(Paused))
    await asyncio.sleep(0.3)
    assert world.site.of_kind(Paused) == [Paused(why="outside your schedule")]
    assert not world.site.of_kind(LeaseRequest), "nothing is asked for outside the schedule"
    assert agent.status.status == "paused: outside your schedule"

    readings.now = MONDAY_EVENING
    assert await asyncio.wait_for(running, 30) == 0
    assert world.site.of_kind(Paused)[-1] == Paused(why=""), "the site hears it works again"
    assert [d.lease_id for d in world.site.of_kind(LeaseDone)] == [1]


async def test_a_control_that_stops_work_mid_lease_gives_the_lease_back_at_once(
    world: World, config: AgentConfig, quick_controls: None, long_leases: threading.Event
) -> None:
    readings = Readings()
    started = long_leases
    world.site.negotiates = True
    config = replace(config, max_leases=1, controls=Controls(pause_on_battery=True))
    world.site.replies = [world.lease(1, [(0, 8)])]
    agent = Agent(config, backoff=FAST_BACKOFF, benchmark_s=0.01, signals=readings.signals())
    running = asyncio.create_task(agent.run())

    await _until(started.is_set)
    readings.battery = True  # unplugged mid-lease
    await _until(lambda: world.site.of_kind(LeaseRelease))
    assert world.site.of_kind(LeaseRelease)[0].lease_id == 1
    assert not world.site.of_kind(LeaseDone), "nothing of the unfinished lease is reported"
    assert Paused(why="on battery") in world.site.of_kind(Paused)
    agent.request_stop()
    assert await asyncio.wait_for(running, 30) == 0


async def test_a_site_older_than_2_8_is_not_told_of_pauses_it_cannot_read(
    world: World, config: AgentConfig, quick_controls: None
) -> None:
    # A 2.7 site refuses a message kind it does not know: the agent keeps its pause to itself.
    readings = Readings()
    config = replace(config, max_leases=1, controls=Controls(schedule=parse_schedule("mon-fri 18:00-08:00")))
    world.site.replies = [world.lease(1, [(0, 8)])]
    agent = Agent(config, backoff=FAST_BACKOFF, benchmark_s=0.01, signals=readings.signals())
    running = asyncio.create_task(agent.run())
    await _until(lambda: agent.status.status == "paused: outside your schedule" and world.site.connections)
    await asyncio.sleep(0.3)
    readings.now = MONDAY_EVENING

    assert await asyncio.wait_for(running, 30) == 0
    assert not world.site.of_kind(Paused) and [d.lease_id for d in world.site.of_kind(LeaseDone)] == [1]


def test_the_other_programs_share_of_the_cpus_is_read_from_proc() -> None:
    # On the Linux machines that run these tests: a share between 0 and 1, never "cannot tell".
    from crowdtrain_agent.controls import OtherCpu

    meter = OtherCpu()
    readings = [meter(), meter()]
    assert all(r is not None and 0.0 <= r <= 1.0 for r in readings), readings


async def test_controls_set_on_my_devices_come_with_the_welcome_and_the_machines_own_come_first(
    world: World, config: AgentConfig, quick_controls: None
) -> None:
    readings = Readings()
    world.site.negotiates = True
    world.site.controls = DeviceControls(schedule="mon-fri 18:00-08:00", pause_on_battery=True)
    world.site.replies = [world.lease(1, [(0, 8)])]
    agent = Agent(replace(config, max_leases=1), backoff=FAST_BACKOFF, benchmark_s=0.01, signals=readings.signals())
    running = asyncio.create_task(agent.run())

    await _until(lambda: Paused(why="outside your schedule") in world.site.of_kind(Paused))
    assert not world.site.of_kind(LeaseRequest), "the site's schedule holds it at noon"
    readings.now = MONDAY_EVENING
    assert await asyncio.wait_for(running, 30) == 0

    # The machine's own schedule (a flag, say) wins over the site's: noon is allowed here.
    own = replace(config, max_leases=1, controls=Controls(schedule=parse_schedule("mon 11:00-13:00")),
                  local_controls=frozenset({"schedule"}))  # fmt: skip
    world.site.replies = [world.lease(2, [(8, 8)])]
    readings.now = MONDAY_NOON
    assert (
        await asyncio.wait_for(Agent(own, backoff=FAST_BACKOFF, benchmark_s=0.01, signals=readings.signals()).run(), 30)
        == 0
    )
    assert [d.lease_id for d in world.site.of_kind(LeaseDone)] == [1, 2]


async def test_controls_changed_on_my_devices_stop_a_running_lease_and_clearing_them_allows_work(
    world: World, config: AgentConfig, quick_controls: None, long_leases: threading.Event
) -> None:
    # 2.9: the site pushes the change; the volunteer does not restart her agent for it.
    readings = Readings()
    readings.battery = True  # on battery all along: only the pushed control makes that matter
    started = long_leases
    world.site.negotiates = True
    world.site.replies = [world.lease(1, [(0, 8)])]
    agent = Agent(replace(config, max_leases=None), backoff=FAST_BACKOFF, benchmark_s=0.01, signals=readings.signals())
    running = asyncio.create_task(agent.run())

    await _until(started.is_set)
    await world.site.push(ControlsChanged(controls=DeviceControls(pause_on_battery=True)))
    await _until(lambda: world.site.of_kind(LeaseRelease))
    assert world.site.of_kind(LeaseRelease)[0].lease_id == 1 and not world.site.of_kind(LeaseDone)
    assert Paused(why="on battery") in world.site.of_kind(Paused)

    await world.site.push(ControlsChanged(controls=None))  # cleared on My devices
    await _until(lambda: world.site.of_kind(Paused)[-1] == Paused(why=""))
    agent.request_stop()
    assert await asyncio.wait_for(running, 30) == 0


async def test_cpu_threads_set_on_my_devices_apply_between_leases_unless_the_machine_sets_its_own(
    world: World, config: AgentConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    seen: list[int] = []  # the threads each compute ran with, read in the compute thread itself
    honest = trainer.compute_gradient

    def counting(*args: Any, **kwargs: Any) -> Any:
        seen.append(torch.get_num_threads())
        return honest(*args, **kwargs)

    monkeypatch.setattr(trainer, "compute_gradient", counting)
    world.site.negotiates = True
    world.site.controls = DeviceControls(threads=1)
    world.site.replies = [world.lease(1, [(0, 8)])]
    agent = Agent(replace(config, max_leases=1), backoff=FAST_BACKOFF, benchmark_s=0.01)
    assert await asyncio.wait_for(agent.run(), 30) == 0
    world.site.replies = [world.lease(2, [(8, 8)])]
    own = replace(config, max_leases=1, threads=2)  # --threads 2 on the machine
    assert await asyncio.wait_for(Agent(own, backoff=FAST_BACKOFF, benchmark_s=0.01).run(), 30) == 0

    assert seen == [1, 2], "the site's thread count is used unless the machine names its own"
    assert [d.lease_id for d in world.site.of_kind(LeaseDone)] == [1, 2]
