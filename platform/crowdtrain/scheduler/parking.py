"""Requests that wait for room: parked in the hot state, woken by the commit, release or copy that makes it.

A refused lease request need not poll: the gateway parks it here and the
event that makes room (a commit, a released lease, a verification copy)
wakes the socket, which asks again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import seam
from .configs import campaign_config
from .leasing import lease_size
from .scripts import run


def park(
    campaign_id: int, device_id: int, samples_per_s: float | None, channel: str, ready_at: int, leave: str = ""
) -> str | None:
    """Queue a refused request to be woken by the commit that makes room; returns its place (None: room is there now).

    A commit wakes requests until the samples they would lease fill the step it
    freed, so it counts each by the lease it would get. ``leave`` takes an
    earlier place out of the queue in the same call.
    """
    config = campaign_config(campaign_id)
    if config is None:
        return None
    want = min(lease_size(config, device_id, samples_per_s)[0], config.target_batch_size)
    owner = seam.standing().owner_of(device_id) or 0  # kept so a verification copy can call another volunteer
    answer = run(config, "park", _park_args(channel=channel, ready_at=ready_at, want=want, owner=owner, leave=leave))
    return None if answer.get("ready") else str(answer.get("member") or "") or None


def _park_args(
    *, channel: str = "", ready_at: int = 0, want: int = 0, owner: int = 0, leave: str = "", skip: str = "",
    pass_on: int = 0,
) -> dict[str, Any]:  # fmt: skip
    return {
        "channel": channel, "ready_at": ready_at, "want": want, "owner": owner, "leave": leave, "skip": skip,
        "pass_on": pass_on,
    }  # fmt: skip


def unpark(campaign_id: int, member: str) -> None:
    config = campaign_config(campaign_id)
    if config is not None:
        run(config, "park", _park_args(leave=member))


def pass_on_wake(campaign_id: int, *, any_step: bool = False) -> list[str]:
    """Who gets a turn that would otherwise go unused: the first waiting request.

    A woken socket had no request left to serve (it was answered
    meanwhile): the next request waiting for a step that is open now gets
    its place, so a commit's room is never left unused. With ``any_step``,
    a released lease put samples back into the open step: the first waiting
    request is woken whatever step it waits for.
    """
    config = campaign_config(campaign_id)
    if config is None:
        return []
    answer = run(config, "park", _park_args(pass_on=2 if any_step else 1))
    return [str(c) for c in answer.get("woken") or []]


def wake_for_copy(campaign_id: int, skip_volunteers: Sequence[int]) -> list[str]:
    """Who is called to a verification copy that just queued: the first request waiting, of another volunteer.

    A copy needs no room in a step, so a request waiting for a commit can
    take it now. Left waiting, the copy is served only to the next request
    that comes in, and when one fast device takes every lease while the
    others wait, none comes: its base version leaves the aggregators'
    window, the check ends without a verdict, and that device's work is
    credited unchecked. At most one request is called per copy.
    """
    config = campaign_config(campaign_id)
    if config is None:
        return []
    answer = run(config, "park", _park_args(pass_on=3, skip=",".join(str(v) for v in skip_volunteers)))
    return [str(c) for c in answer.get("woken") or []]
