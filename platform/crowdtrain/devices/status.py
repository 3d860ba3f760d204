"""My devices' live part: each device's state now, speed and recent leases, for the page and its JSON feed.

The page renders these rows once and ``devices-live.js`` polls ``/devices/status``
for the same rows every few seconds, so both say the same words. A poll costs
three queries (the devices, their recent leases, nothing per device) and two
Redis reads, however many devices and leases the volunteer has.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.contrib.auth.models import User
from django.db import connection
from django.db.models import F, QuerySet, Window
from django.db.models.functions import RowNumber
from django.utils import timezone
from django.utils.dateformat import format as format_date
from django.utils.timesince import timesince

from crowdtrain.accounts.models import Device
from crowdtrain.scheduler.hotstate import hot_state
from crowdtrain.scheduler.models import Lease

from . import actions
from .activity import describe, plural, read_activities

RECENT_LEASES = 10  # per device, newest first
DEVICES_PER_QUERY = 50  # devices whose recent leases one query reads
LEASE_FIELDS = ("id", "device_id", "campaign_id", "campaign__name", "num_samples", "state", "finished_at", "compute_s")


def owned_devices(user: User) -> list[Device]:
    return list(Device.objects.filter(owner=user).order_by("revoked_at", "-created_at"))


def _newest_leases(device_ids: list[int]) -> QuerySet[Lease, dict[str, Any]]:
    """One query for the newest leases of each of these devices.

    On PostgreSQL, a UNION of one ``LIMIT`` per device: each part reads a few
    rows of the (device, id) index, however many leases the device has had.
    SQLite (the development default) cannot limit the parts of a UNION, so it
    numbers each device's leases with a window function instead.
    """
    if connection.features.supports_slicing_ordering_in_compound:
        parts = [
            Lease.objects.filter(device_id=d).order_by("-id").values(*LEASE_FIELDS)[:RECENT_LEASES] for d in device_ids
        ]
        return parts[0].union(*parts[1:], all=True)
    numbered = Window(RowNumber(), partition_by=F("device_id"), order_by=F("id").desc())
    return (
        Lease.objects.filter(device_id__in=device_ids)
        .annotate(newest=numbered)
        .filter(newest__lte=RECENT_LEASES)
        .values(*LEASE_FIELDS)
    )


def _when(moment: datetime | None) -> str:
    return format_date(timezone.localtime(moment), "Y-m-d H:i:s") if moment else ""


def lease_history(device_ids: list[int]) -> dict[int, list[dict[str, Any]]]:
    """Each device's newest leases (newest first): campaign, samples, state, when it finished, its compute time."""
    history: dict[int, list[dict[str, Any]]] = {d: [] for d in device_ids}
    rows: list[dict[str, Any]] = []
    for start in range(0, len(device_ids), DEVICES_PER_QUERY):
        chunk = device_ids[start : start + DEVICES_PER_QUERY]
        if chunk:
            rows.extend(_newest_leases(chunk))
    for row in sorted(rows, key=lambda r: r["id"], reverse=True):
        compute_s = row["compute_s"]
        history[row["device_id"]].append(
            {
                "id": row["id"],
                "campaign": {"id": row["campaign_id"], "name": row["campaign__name"]},
                "samples": row["num_samples"],
                "samples_text": plural(row["num_samples"], "sample"),
                "state": row["state"],
                "finished_at": row["finished_at"].isoformat() if row["finished_at"] else None,
                "finished": _when(row["finished_at"]),
                "compute_s": None if compute_s is None else round(compute_s, 2),
                "compute_text": "" if compute_s is None else f"{compute_s:.1f} s",
            }
        )
    return history


def _campaign_names(history: dict[int, list[dict[str, Any]]], campaign_ids: set[int]) -> dict[int, str]:
    """Names of the campaigns the devices work on now: from their lease history, else one query."""
    names = {row["campaign"]["id"]: row["campaign"]["name"] for rows in history.values() for row in rows}
    missing = campaign_ids - names.keys()
    if missing:
        from crowdtrain.campaigns.models import Campaign

        names.update(Campaign.objects.filter(pk__in=missing).values_list("pk", "name"))
    return names


def _speed(device: Device) -> dict[str, Any]:
    rate = device.samples_per_s
    if not rate:
        return {"samples_per_s": None, "text": "not measured yet"}
    return {"samples_per_s": round(rate, 3), "text": f"{rate:.1f} samples/s"}


def _last_seen(device: Device, online: bool) -> str:
    if online:
        return "now"
    if device.last_seen_at is None:
        return "never"
    return f"{timesince(device.last_seen_at)} ago"


def _now_text(device: Device, online: bool, said: dict[str, Any] | None) -> str:
    if device.is_revoked:
        return "revoked: its agent can no longer connect"
    if said is not None:
        return str(said["text"])
    if online:  # connected since the last batch of news, or to a site process that has not published yet
        return "connected; what it is doing shows here within a few seconds"
    return "offline"


def status_rows(owned: list[Device]) -> dict[int, dict[str, Any]]:
    """What the page and the feed show of each of these devices, by device id."""
    ids = [d.pk for d in owned]
    online = actions.online_ids(owned)
    activities = read_activities(sorted(online))  # an offline device is doing nothing, whatever Redis kept
    history = lease_history(ids)
    names = _campaign_names(history, {a.campaign_id for a in activities.values() if a.campaign_id is not None})
    now = hot_state().clock()
    rows: dict[int, dict[str, Any]] = {}
    for device in owned:
        is_online = device.pk in online
        activity = activities.get(device.pk)
        now_said = describe(activity, names, now) if activity is not None else None
        rows[device.pk] = {
            "id": device.pk,
            "name": device.name,
            "online": is_online,
            "revoked": device.is_revoked,
            "now": now_said,
            "now_text": _now_text(device, is_online, now_said),
            "wait_text": now_said["wait_text"] if now_said else "",
            "speed": _speed(device),
            "samples_accepted": device.samples_accepted,
            "samples_accepted_text": plural(device.samples_accepted, "sample"),
            "last_seen": device.last_seen_at.isoformat() if device.last_seen_at else None,
            "last_seen_text": _last_seen(device, is_online),
            "leases": history[device.pk],
        }
    return rows
