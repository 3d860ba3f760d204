"""What the volunteer lets the agent use, and when: the answer to "may it work right now?".

BOINC's most used settings are these, and a volunteer uninstalls an agent the
first time it makes their game stutter: compute only while the computer is idle
(no keyboard or mouse for N minutes, or the CPU not busy with other work), a
weekly schedule, and not on battery. Threads, GPUs, GPU memory and network
rates are limits rather than pauses; they live in ``AgentConfig`` and the
uploader.

Each signal comes from an injectable ``Signals`` (tests drive the clock and the
idle time by hand). A signal this OS cannot give (no input idle time on a
headless Linux, no battery on a desktop) is ``None``: the control that needs it
says so once, in the log, and does not stop work for it.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

logger = logging.getLogger(__name__)

DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_WINDOW = re.compile(
    r"^(?P<days>[a-z]{3}(?:-[a-z]{3})?(?:,[a-z]{3}(?:-[a-z]{3})?)*)?\s*"
    r"(?P<start>\d{1,2}:\d{2})-(?P<end>\d{1,2}:\d{2})$"
)


class ControlError(ValueError):
    """A control the volunteer wrote that cannot mean anything; the message says how to write it."""


@dataclass(frozen=True)
class Window:
    """Hours of some weekdays when work is allowed: ``start``-``end`` minutes after midnight, ``end`` may wrap."""

    days: frozenset[int]
    start: int
    end: int

    def allows(self, when: datetime) -> bool:
        minute = when.hour * 60 + when.minute
        day = when.weekday()
        if self.start < self.end:
            return day in self.days and self.start <= minute < self.end
        # Past midnight: the evening belongs to its day, the small hours to the day before.
        return (day in self.days and minute >= self.start) or ((day - 1) % 7 in self.days and minute < self.end)


def parse_schedule(text: str) -> tuple[Window, ...]:
    """Windows from text such as ``"mon-fri 18:00-08:00; sat,sun 00:00-24:00"`` (no days: every day).

    Raises:
        ControlError: naming the part that cannot be read.
    """
    windows = []
    for part in filter(None, (p.strip().lower() for p in text.split(";"))):
        match = _WINDOW.match(part)
        if match is None:
            raise ControlError(
                f"schedule part {part!r} is not 'DAYS HH:MM-HH:MM' (e.g. 'mon-fri 18:00-08:00; sat,sun 00:00-24:00')"
            )
        days = _days(match["days"]) if match["days"] else frozenset(range(7))
        start, end = _minutes(match["start"], part), _minutes(match["end"], part)
        if start == end:
            raise ControlError(f"schedule part {part!r} is empty: its start and end are the same time")
        windows.append(Window(days, start, end))
    return tuple(windows)


def _days(text: str) -> frozenset[int]:
    days: set[int] = set()
    for item in text.split(","):
        first, _, last = item.partition("-")
        if first not in DAYS or (last and last not in DAYS):
            raise ControlError(f"unknown day in {item!r}: use {', '.join(DAYS)}")
        a, b = DAYS.index(first), DAYS.index(last or first)
        days.update(range(a, b + 1) if a <= b else [*range(a, 7), *range(0, b + 1)])
    return frozenset(days)


def _minutes(text: str, part: str) -> int:
    hours, minutes = (int(x) for x in text.split(":"))
    if minutes > 59 or hours > 24 or (hours == 24 and minutes):
        raise ControlError(f"time {text!r} in {part!r} is not between 00:00 and 24:00")
    return hours * 60 + minutes


@dataclass(frozen=True)
class Controls:
    """The volunteer's controls over when the agent works (flags, config file, or the site's device settings)."""

    idle_after_min: float | None = None  # only after this long without keyboard or mouse input
    max_other_cpu: float | None = None  # only while other programs use less than this share of the CPUs (0-1)
    schedule: tuple[Window, ...] = ()  # only within these windows (none: any time)
    pause_on_battery: bool = False

    def __post_init__(self) -> None:
        if self.idle_after_min is not None and not 0 <= self.idle_after_min <= 24 * 60:
            raise ControlError(f"idle minutes must be between 0 and 1440, got {self.idle_after_min}")
        if self.max_other_cpu is not None and not 0 < self.max_other_cpu <= 1:
            raise ControlError(f"the other programs' CPU share must be above 0 and at most 1, got {self.max_other_cpu}")

    @property
    def any(self) -> bool:
        return bool(self.idle_after_min is not None or self.max_other_cpu is not None or self.schedule
                    or self.pause_on_battery)  # fmt: skip


def describe_controls(controls: Controls) -> str:
    """The controls in words, for the log ("after 5 idle minutes; mon-fri 18:00-08:00; not on battery")."""
    parts = []
    if controls.idle_after_min is not None:
        parts.append(f"after {controls.idle_after_min:g} idle minutes")
    if controls.max_other_cpu is not None:
        parts.append(f"while other programs use at most {controls.max_other_cpu:.0%} of the CPUs")
    if controls.schedule:
        parts.append(f"{len(controls.schedule)} scheduled window{'s' if len(controls.schedule) > 1 else ''}")
    if controls.pause_on_battery:
        parts.append("not on battery")
    return "; ".join(parts)


@dataclass
class Signals:
    """Where the controls' readings come from; each returns None where this OS cannot tell."""

    now: Callable[[], datetime] = datetime.now
    input_idle_s: Callable[[], float | None] = lambda: _input_idle_s()
    other_cpu: Callable[[], float | None] = field(default_factory=lambda: OtherCpu())
    on_battery: Callable[[], bool | None] = lambda: _on_battery()


@dataclass
class Gate:
    """Decides, each time it is asked, whether the agent may work, and says why not.

    A reading that cannot be had is logged once per control, at warning level,
    and allows work: a control the OS cannot serve must not stop a volunteer
    who asked for something else.
    """

    controls: Controls
    signals: Signals = field(default_factory=Signals)
    _told: set[str] = field(default_factory=set)

    def why_not(self) -> str:
        """ "" when work is allowed now, else why not, in words for the panel ("outside your schedule")."""
        c = self.controls
        if c.schedule and not any(w.allows(self.signals.now()) for w in c.schedule):
            return "outside your schedule"
        if c.pause_on_battery:
            battery = self.signals.on_battery()
            if battery is None:
                self._cannot("pause_on_battery", "this computer does not say whether it runs on battery")
            elif battery:
                return "on battery"
        if c.idle_after_min is not None:
            idle = self.signals.input_idle_s()
            if idle is None:
                self._cannot("idle_after_min", "this system does not say how long keyboard and mouse were idle")
            elif idle < c.idle_after_min * 60:
                return f"the computer is in use (input {_ago(idle)} ago; waits for {c.idle_after_min:g} idle minutes)"
        if c.max_other_cpu is not None:
            busy = self.signals.other_cpu()
            if busy is None:
                self._cannot("max_other_cpu", "this system does not say how busy its CPUs are")
            elif busy > c.max_other_cpu:
                return f"other programs use {busy:.0%} of the CPUs (over your {c.max_other_cpu:.0%})"
        return ""

    def _cannot(self, control: str, why: str) -> None:
        if control not in self._told:
            self._told.add(control)
            logger.warning("the %s control is ignored: %s", control, why)


def _ago(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def _input_idle_s() -> float | None:
    """Seconds since the last keyboard or mouse input, where the OS says (Windows; X11 with xprintidle)."""
    import platform

    if platform.system() == "Windows":  # pragma: no cover - not on the test machines
        import ctypes

        class LastInput(ctypes.Structure):
            _fields_ = [("cbSize", ctypes.c_uint), ("dwTime", ctypes.c_uint)]

        info = LastInput()
        info.cbSize = ctypes.sizeof(info)
        if not ctypes.windll.user32.GetLastInputInfo(ctypes.byref(info)):  # type: ignore[attr-defined]
            return None
        return (ctypes.windll.kernel32.GetTickCount() - info.dwTime) / 1000.0  # type: ignore[attr-defined]
    import shutil
    import subprocess

    if platform.system() == "Linux" and shutil.which("xprintidle"):
        try:
            out = subprocess.run(["xprintidle"], capture_output=True, text=True, timeout=2, check=True).stdout
            return int(out.strip()) / 1000.0
        except (OSError, subprocess.SubprocessError, ValueError):
            return None
    return None


class OtherCpu:
    """The share of all CPUs other programs used since the last reading (Linux's /proc); None elsewhere.

    The whole machine's busy time less this process's own (its compute threads included), over the
    machine's total: what the volunteer's other work took. The first reading samples twice, 0.2 s apart.
    """

    def __init__(self) -> None:
        self._last: tuple[int, int, int] | None = None

    def __call__(self) -> float | None:
        now = _cpu_times()
        if now is None:
            return None
        if self._last is None:
            time.sleep(0.2)
            self._last, now = now, _cpu_times()
            if now is None:
                return None
        (total0, busy0, own0), (total1, busy1, own1) = self._last, now
        self._last = now
        if total1 <= total0:
            return 0.0
        return max(0.0, min(1.0, ((busy1 - busy0) - (own1 - own0)) / (total1 - total0)))


def _cpu_times() -> tuple[int, int, int] | None:
    """(all CPUs' jiffies, their busy jiffies, this process's jiffies), or None without /proc."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and iowait
    return sum(fields[:8]), sum(fields[:8]) - idle, int(own[11]) + int(own[12])  # utime and stime


def _on_battery() -> bool | None:
    """Whether the computer runs on battery, where the OS says (Linux's power_supply class); None elsewhere."""
    supplies = Path("/sys/class/power_supply")
    try:
        mains = [p for p in supplies.iterdir() if (p / "type").read_text().strip() == "Mains"]
        batteries = [p for p in supplies.iterdir() if (p / "type").read_text().strip() == "Battery"]
    except OSError:
        return None
    if not batteries:
        return None  # a desktop: nothing to pause for
    if mains:
        return not any((p / "online").read_text().strip() == "1" for p in mains)
    return any((p / "status").read_text().strip() == "Discharging" for p in batteries)
