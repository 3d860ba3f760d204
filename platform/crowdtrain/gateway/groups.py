"""Keeps this process's sockets in their channel-layer groups for as long as the sockets stay open.

A group membership does not last on its own. Channels' layers drop a member a
day after it joined (``group_expiry``; channels_redis lets the group's key
expire with it), and a Redis that restarted empty forgets every group at once.
Volunteers leave their agent running for days. A device socket that fell out of
its group can no longer be replaced by the device's newer connection (4012) or
closed when the device is revoked, and an idle socket no longer hears its
campaign's versions. So each housekeeping round asks the layer whether Redis
forgot its groups (a restart, a flush: one round trip) and adds every
membership again at once when it did; besides, every membership is added
again every ``REFRESH_S``, inside channels' expiry. The due ones go in one
pipelined round trip, whatever the number of sockets. Heartbeats pay nothing.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any

logger = logging.getLogger(__name__)

# How often a membership is added again although Redis said nothing was lost: far inside channels'
# day-long expiry, and rare enough that re-adding thousands of idle sockets' groups costs their site
# process next to nothing (docs/performance.md, "Channel-layer groups").
REFRESH_S = 3600.0

Membership = tuple[str, str]  # (group, channel)


async def add_many(layer: Any, memberships: list[Membership]) -> None:
    """Add every (group, channel); one pipelined round trip per Redis host where the layer can batch."""
    batched = getattr(layer, "group_add_many", None)
    if batched is not None:
        await batched(memberships)
        return
    for group, channel in memberships:
        await layer.group_add(group, channel)


class Memberships:
    """The groups this process's sockets joined, oldest refresh first.

    Consumers join and leave through ``join`` and ``leave``; ``refresh`` (the
    housekeeping round) adds again those not added for ``REFRESH_S``. Each call
    touches only the memberships it names or that are due: O(1) per socket.
    """

    def __init__(self) -> None:
        self._added: OrderedDict[Membership, float] = OrderedDict()  # membership -> when last added (monotonic)
        self._groups: dict[str, set[str]] = {}  # channel -> its groups

    def __len__(self) -> int:
        return len(self._added)

    async def join(self, layer: Any, group: str, channel: str) -> None:
        await layer.group_add(group, channel)
        self._added[(group, channel)] = time.monotonic()
        self._added.move_to_end((group, channel))
        self._groups.setdefault(channel, set()).add(group)

    async def leave(self, layer: Any, group: str, channel: str) -> None:
        self._forget(group, channel)
        await layer.group_discard(group, channel)

    def drop(self, channel: str) -> list[str]:
        """Forget every membership of a closing socket at once, before any await; returns its groups.

        Its ``disconnect`` then leaves them in the layer: cut short there (daphne
        cancels a cleanup after its close timeout), nothing here re-adds them.
        """
        groups = sorted(self._groups.pop(channel, ()))
        for group in groups:
            self._added.pop((group, channel), None)
        return groups

    def _forget(self, group: str, channel: str) -> None:
        self._added.pop((group, channel), None)
        groups = self._groups.get(channel)
        if groups is not None:
            groups.discard(group)
            if not groups:
                del self._groups[channel]

    def due(self, now: float) -> list[Membership]:
        """The memberships not added for ``REFRESH_S``, marked as added now."""
        taken: list[Membership] = []
        for _ in range(len(self._added)):  # each at most once, whatever REFRESH_S is
            membership, added = next(iter(self._added.items()))
            if now - added < REFRESH_S:
                break
            self._added.move_to_end(membership)
            self._added[membership] = now
            taken.append(membership)
        return taken

    async def refresh(self, layer: Any, now: float | None = None) -> int:
        """Add again every membership that is due; returns how many.

        A socket that left while the batch was on its way is removed from the
        group again: the batch may have reached Redis after its discard.
        """
        forgotten = getattr(layer, "groups_forgotten", None)
        if forgotten is not None and await forgotten():
            logger.warning("Redis lost the channel layer's groups; adding %d memberships again", len(self._added))
            for membership in self._added:
                self._added[membership] = float("-inf")
        due = self.due(time.monotonic() if now is None else now)
        if not due:
            return 0
        try:
            await add_many(layer, due)
        except Exception:
            for membership in reversed(due):  # due again at the next round, at the front where they were
                if membership in self._added:
                    self._added.move_to_end(membership, last=False)
                    self._added[membership] = float("-inf")
            raise
        for group, channel in due:
            if (group, channel) not in self._added:
                await layer.group_discard(group, channel)
        return len(due)


memberships = Memberships()
