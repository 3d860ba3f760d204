"""What each device is doing now, as the site last told its agent: kept by its connection, read by My devices.

A connection records every answer it sends its agent (a lease, a refusal, a
report's acknowledgement, a request parked until the next commit) as one small
``Activity``. ``hotstate.Presence`` publishes the latest one per device to
Redis with its batch of liveness, so recording costs a dictionary write and
neither the database nor Redis sees a call per message. My devices reads them
back (``read_activities``) and words them (``describe``) for people.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, fields, replace
from functools import partial
from typing import Any, Literal, get_args

from crowdtrain.scheduler.hotstate import hot_state, presence
from crowdtrain_agent.protocol import DoneAck, Lease, NoLease, ReleaseAck, no_lease_status

logger = logging.getLogger(__name__)

Kind = Literal["connected", "training", "idle", "queued", "reported", "released", "paused"]
KINDS: frozenset[str] = frozenset(get_args(Kind))
MAX_HELD = 8  # leases a connection remembers for the page; an agent holds one or two at a time


@dataclass(frozen=True)
class Activity:
    """What the site last told one device, and when (``at``, the scheduler's clock, Unix seconds)."""

    kind: Kind
    at: float
    campaign_id: int | None = None
    lease_id: int | None = None
    num_samples: int | None = None
    deadline: float | None = None  # training: when the lease is due (Unix seconds)
    held: int = 0  # training: leases this device holds, the one shown included
    reason: str = ""  # idle: NoLease.reason
    detail: str = ""  # idle: NoLease.detail; reported: why a report was not counted
    retry_after_s: float | None = None  # idle: the agent asks again within this long
    ready_at_step: int | None = None  # queued: the request is answered once this many steps are committed
    accepted: bool | None = None  # reported


_FIELDS = tuple(f.name for f in fields(Activity))


def encode_activity(activity: Activity) -> str:
    # By name, not ``asdict``: its deep copy of every field cost more than the JSON (no field is nested).
    kept = {name: value for name in _FIELDS if (value := getattr(activity, name)) is not None and value != ""}
    return json.dumps(kept, separators=(",", ":"))


def _field(raw: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = raw.get(name)
    if value is None:
        return None
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ValueError(f"{name} is {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} is {value!r}")
    return value


def decode_activity(text: str | None) -> Activity | None:
    """The record ``encode_activity`` wrote, or None for none or one this code cannot read (logged, not raised).

    The page must show the rest of a device even when Redis holds something
    odd (a record of a newer site version, say).
    """
    if not text:
        return None
    try:
        raw = json.loads(text)
        if not isinstance(raw, dict) or raw.get("kind") not in KINDS:
            raise ValueError(f"kind is {raw.get('kind') if isinstance(raw, dict) else raw!r}")
        number = (int, float)
        activity = Activity(
            kind=raw["kind"],
            at=float(_field(raw, "at", number) or 0.0),
            campaign_id=_field(raw, "campaign_id", int),
            lease_id=_field(raw, "lease_id", int),
            num_samples=_field(raw, "num_samples", int),
            deadline=_field(raw, "deadline", number),
            held=_field(raw, "held", int) or 0,
            reason=_field(raw, "reason", str) or "",
            detail=_field(raw, "detail", str) or "",
            retry_after_s=_field(raw, "retry_after_s", number),
            ready_at_step=_field(raw, "ready_at_step", int),
            accepted=_field(raw, "accepted", bool),
        )
        if activity.kind == "idle" and not activity.reason:
            raise ValueError("an idle record without a reason")
        if activity.kind in {"training", "reported", "released"} and activity.lease_id is None:
            raise ValueError(f"a {activity.kind} record without a lease")
        return activity
    except (ValueError, TypeError) as exc:
        logger.info("ignoring a device activity record this site cannot read (%s): %.200s", exc, text)
        return None


class Tracker:
    """One connection's record of what it told its device, handed to ``presence`` on every change.

    Args:
        device_id: the connection's device.
    """

    def __init__(self, device_id: int) -> None:
        self.device_id = device_id
        self._held: dict[int, Activity] = {}  # lease id -> its "training" record, oldest first
        self._queued: Activity | None = None  # a request parked at the site, until it is answered

    def _note(self, activity: Activity) -> None:
        presence.note(self.device_id, partial(encode_activity, activity))

    def connected(self) -> None:
        self._note(Activity(kind="connected", at=hot_state().clock()))

    def told(self, message: Any, campaign_id: int | None = None) -> None:
        """Record an answer on its way to the agent; other messages change nothing.

        Args:
            message: the message sent (``Lease``, ``NoLease``, ``DoneAck``, ``ReleaseAck`` count).
            campaign_id: the campaign a ``NoLease`` speaks for, when the site knows it.
        """
        now = hot_state().clock()
        if isinstance(message, Lease | NoLease):
            self._queued = None  # the parked request, if any, has its answer
        if isinstance(message, Lease):
            self._held[message.lease_id] = Activity(
                kind="training",
                at=now,
                campaign_id=message.campaign_id,
                lease_id=message.lease_id,
                num_samples=message.num_samples,
                deadline=now + message.deadline_s,
            )
            while len(self._held) > MAX_HELD:  # leases that expired unreported are forgotten oldest first
                del self._held[next(iter(self._held))]
            self._note_held()
        elif isinstance(message, NoLease):
            self._note(
                Activity(
                    kind="idle",
                    at=now,
                    campaign_id=campaign_id,
                    reason=message.reason,
                    detail=message.detail,
                    retry_after_s=message.retry_after_s,
                )
            )
        elif isinstance(message, DoneAck | ReleaseAck):
            done = self._held.pop(message.lease_id, None)
            if self._held:
                self._note_held()
                return
            if self._queued is not None:  # its next request already waits for a step: that is what it does now
                self._note(self._queued)
                return
            accepted = message.accepted if isinstance(message, DoneAck) else None
            self._note(
                Activity(
                    kind="reported" if isinstance(message, DoneAck) else "released",
                    at=now,
                    campaign_id=done.campaign_id if done else None,
                    lease_id=message.lease_id,
                    num_samples=done.num_samples if done else None,
                    accepted=accepted,
                    detail=message.reason if isinstance(message, DoneAck) and not message.accepted else "",
                )
            )

    def paused(self, why: str) -> None:
        """The agent's volunteer stopped it with one of their controls (``why``), or let it work again ("")."""
        now = hot_state().clock()
        self._note(Activity(kind="paused", at=now, detail=why) if why else Activity(kind="connected", at=now))

    def queued(self, campaign_id: int, ready_at_step: int) -> None:
        """The device's request waits at the site for the commit that makes room in a step."""
        self._queued = Activity(
            kind="queued", at=hot_state().clock(), campaign_id=campaign_id, ready_at_step=ready_at_step
        )
        if not self._held:  # else it still trains: the queued request is its next lease, asked for ahead
            self._note(self._queued)

    def _note_held(self) -> None:
        newest = self._held[next(reversed(self._held))]
        self._note(replace(newest, held=len(self._held)))


def read_activities(device_ids: list[int]) -> dict[int, Activity]:
    """The published activity of these devices (one Redis read); devices without one are left out."""
    found: dict[int, Activity] = {}
    for device_id, text in hot_state().activities(device_ids).items():
        activity = decode_activity(text)
        if activity is not None:
            found[device_id] = activity
    return found


# ------------------------------------------------------------ words for people


def plural(count: int, noun: str) -> str:
    """``"1 sample"``, ``"2 samples"``, ``"0 samples"``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def duration(seconds: float) -> str:
    """A wait as a person reads it: ``"8 s"``, ``"2 min 5 s"``, ``"1 h 10 min"``."""
    total = max(0, round(seconds))
    if total < 60:
        return f"{total} s"
    minutes, secs = divmod(total, 60)
    if minutes < 60:
        return f"{minutes} min {secs} s" if secs else f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if minutes else f"{hours} h"


def describe(activity: Activity, campaign_names: dict[int, str], now: float) -> dict[str, Any]:
    """The page's "Now:" for one device: its text, its campaign and lease, and the wait ahead (seconds or None).

    An idle device's text is the agent's own status line for the same refusal
    (``no_lease_status``), so the terminal and the page say the same thing.
    """
    cid = activity.campaign_id
    campaign = campaign_names.get(cid, f"campaign {cid}") if cid is not None else ""
    of = f" of {campaign}" if campaign else ""
    wait: float | None = None
    if activity.kind == "training":
        due = (activity.deadline or now) - now
        when = f"due in {duration(due)}" if due >= 0 else f"due {duration(-due)} ago"
        text = f"training lease {activity.lease_id}{of} ({plural(activity.num_samples or 0, 'sample')}, {when})"
        if activity.held > 1:
            text += f"; {activity.held} leases in hand"
    elif activity.kind == "idle":
        text = no_lease_status(activity.reason, activity.detail)
        if activity.retry_after_s is not None:
            wait = max(0.0, activity.at + activity.retry_after_s - now)
    elif activity.kind == "queued":
        steps = plural(activity.ready_at_step or 0, "step")
        text = f"waiting for the next step{of} (queued at the site until the campaign has committed {steps})"
    elif activity.kind == "reported":
        why = f" ({activity.detail})" if activity.detail else ""
        outcome = "accepted" if activity.accepted else f"not counted{why}"
        text = f"reported lease {activity.lease_id}{of}: {outcome}"
    elif activity.kind == "released":
        text = f"gave back lease {activity.lease_id}{of} unfinished"
    elif activity.kind == "paused":
        text = f"paused: {activity.detail}"
    else:
        text = "connected, has not asked for work yet"
    return {
        "kind": activity.kind,
        "text": text,
        "campaign": {"id": cid, "name": campaign} if cid is not None else None,
        "lease_id": activity.lease_id,
        "expected_wait_s": None if wait is None else round(wait, 1),
        "wait_text": f"asks again within {duration(wait)}" if wait else "",
        "since_s": round(max(0.0, now - activity.at), 1),
    }
