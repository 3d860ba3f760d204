"""The records the hot state's scripts keep and answer with, as typed structs.

The Lua scripts (``lua/``) store each lease as a JSON object in the campaign's
``leases`` hash under one- and two-letter keys: a busy campaign holds thousands,
and every script run reads and writes some. Python code reads them through these
structs, decoded once where a script's answer comes in, so the keys have one
legend (the field comments below, and ``lua/prelude.lua``'s header) and a
misspelt name fails at the type check instead of at run time.
"""

from __future__ import annotations

from typing import Any, cast

import msgspec


class LeaseRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One lease in the hot state (``lua/prelude.lua``: ``lease_get``, ``lease_put``)."""

    id: int  # the lease id: the database row's primary key, drawn before the script runs (``ids``)
    device: int = msgspec.field(name="d")  # the device it was issued to
    step: int = msgspec.field(name="s")  # the step its samples count in, reserved at issue
    samples: int = msgspec.field(name="n")  # how many samples
    base_version: int = msgspec.field(name="b")  # the parameter version it computes on
    # Its samples in the campaign's global order: (epoch, first sample, count) spans (``lease_rows.to_shards``).
    ranges: list[list[int]] = msgspec.field(name="r")
    # active (out with the device), accepted (reported, counted in its step); expired, released, rejected.
    state: str = msgspec.field(name="st")
    issued_at: float = msgspec.field(name="t0")  # seconds since the epoch
    deadline: float = msgspec.field(name="dl")  # it expires past this (seconds since the epoch)
    twin: int = msgspec.field(name="tw", default=0)  # its backup lease, or the slow one it backs up (0: none)
    backup: int = msgspec.field(name="bk", default=0)  # 1: this lease is a backup of a slow one
    # Its volunteer, when it was issued under a probation cap (0: uncapped; ``lua/prelude.lua`` shares).
    owner: int = msgspec.field(name="o", default=0)
    loss: float = 0.0  # the sum of its samples' losses, as reported
    compute_s: float = msgspec.field(name="cs", default=0.0)  # compute time the agent reported, capped
    finished_at: float = msgspec.field(name="t1", default=0.0)  # when it was reported or ended (0: not yet)
    why: str = ""  # why it ended, when it did not end accepted
    # What it cost the agent's link (``network``): bytes up (0: not reported), bytes down, seconds waited.
    bytes_up: int = msgspec.field(name="nu", default=0)
    bytes_down: int = msgspec.field(name="nd", default=0)
    network_s: float = msgspec.field(name="ns", default=0.0)


class FullStep(msgspec.Struct, frozen=True, kw_only=True):
    """A step the ``done`` or ``take`` script found full: what ``commits.commit_full_steps`` writes."""

    step: int  # its index
    line: int = 0  # the campaign's timeline the leases were gathered on (0: before timelines)
    leases: list[LeaseRecord] = msgspec.field(default_factory=list)  # its accepted leases
    queued: bool = False  # handed to a committer instead of written by the reporting process


def lease_record(raw: Any) -> LeaseRecord:
    """A lease record as a script answered it (a dict decoded from its JSON)."""
    return msgspec.convert(raw, LeaseRecord, strict=False)


def full_step(raw: Any) -> FullStep:
    """A full step as a script answered it."""
    return msgspec.convert(raw, FullStep, strict=False)


def to_script(record: LeaseRecord) -> dict[str, Any]:
    """The record as the scripts store it (short keys), for ``load.lua`` rebuilding a campaign."""
    return cast(dict[str, Any], msgspec.to_builtins(record))
