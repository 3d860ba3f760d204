"""The housekeeping round of one site process: the jobs of ``crowdtrain.periodic.ROUND_JOBS``, at their periods.

Publish who is connected, sweep expired leases, keep sockets in their
channel-layer groups, stamp "last seen", reload volunteers' records, write the
admin dashboard's minute, check every running campaign's step counter against
its rows (``scheduler.invariants``).

It runs on the process's event loop as one task, started by the first
connection, so a process that is behind on its messages still publishes its
volunteers' liveness on time. Each round costs a few batched calls whatever
the number of connections.
"""

from __future__ import annotations

import asyncio
import logging
import time

from channels.layers import get_channel_layer
from django.conf import settings
from django.utils import timezone

from crowdtrain.accounts.models import Device
from crowdtrain.lib.offloop import offloop
from crowdtrain.ops import history
from crowdtrain.periodic import LAST_SEEN_DB_EVERY_S, round_interval_s
from crowdtrain.scheduler import endings, invariants
from crowdtrain.scheduler.commits import Commit
from crowdtrain.scheduler.hotstate import presence
from crowdtrain.verification import checks, standing

from .admission import admission
from .groups import memberships
from .outbox import publish_commits, send_commits, send_outbox, wake

logger = logging.getLogger(__name__)


def _stamp_last_seen() -> int:
    ids = presence.take_db_batch()
    for start in range(0, len(ids), 5000):
        Device.objects.filter(pk__in=ids[start : start + 5000]).update(last_seen_at=timezone.now())
    return len(ids)


def _expire_overdue() -> tuple[list[Commit], dict[int, list[str]]]:
    """Expire overdue leases; the steps that closed go out to their aggregators from this thread.

    Returns:
        The commits, and per campaign the waiting requests woken because a backup of a late lease is due.
    """
    _, commits, woken = endings.expire_all_overdue()
    publish_commits(commits)
    return commits, woken


class Housekeeping:
    """One task per process; ``start`` is cheap and idempotent."""

    def __init__(self) -> None:
        self._task: asyncio.Task[None] | None = None
        self._last_db = time.monotonic()  # when "last seen" was last written
        self._last_records = time.monotonic()  # when volunteers' records were last reloaded
        self._minute = int(time.time() // 60)  # the dashboard's history minute in progress: written once ended

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="crowdtrain-housekeeping")

    @property
    def interval_s(self) -> float:
        return round_interval_s(settings.CROWDTRAIN_GONE_AFTER_S)

    async def _run(self) -> None:
        while True:
            asleep = time.monotonic()
            await asyncio.sleep(self.interval_s)
            # How late the loop woke us: a process this far behind on its own work issues no backups.
            admission.loop_lag_s = max(0.0, time.monotonic() - asleep - self.interval_s)
            try:
                await self.round()
            except asyncio.CancelledError:
                raise
            except Exception:  # the next round tries again; a broken round must not end liveness for good
                logger.exception("site housekeeping failed")

    async def round(self) -> None:
        """One round's work: a few batched calls, whatever the number of connections."""
        await offloop(presence.publish)()
        commits, woken = await offloop(_expire_overdue)()
        await send_commits(commits)
        for campaign_id, channels in woken.items():
            await wake(campaign_id, channels)
        if time.monotonic() - self._last_records > standing.RECORD_REFRESH_AT_S / 2:
            self._last_records = time.monotonic()
            await offloop(standing.refresh_records)()
        if time.monotonic() - self._last_db > LAST_SEEN_DB_EVERY_S:
            self._last_db = time.monotonic()
            await offloop(_stamp_last_seen)()
            await offloop(checks.upkeep)()
            await send_outbox(await offloop(invariants.repair_step_counters)())
        if int(time.time() // 60) != self._minute:
            self._minute = int(time.time() // 60)
            await offloop(history.record_minute)()
        await memberships.refresh(get_channel_layer())  # last: a Redis away fails it, after the rest is done


housekeeping = Housekeeping()
