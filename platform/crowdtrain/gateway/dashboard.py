"""The admin dashboard's socket (``/ws/dashboard/``): a snapshot on connect, then one every few seconds.

Browsers, not agents: the route sits behind Channels' session middleware and
an origin check (``routing``), and only staff are accepted; anyone else is
closed with 4003. Snapshots are built only while someone watches, and shared
by every watcher of the process (``ops.dashboard``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings

from crowdtrain.ops import dashboard

logger = logging.getLogger(__name__)

NOT_STAFF = 4003  # the browser's page says "only admins" and does not reconnect


class DashboardConsumer(AsyncWebsocketConsumer):
    _pusher: asyncio.Task[None] | None = None

    async def connect(self) -> None:
        user = self.scope.get("user")
        await self.accept()  # accept first: a close code is only delivered on an open socket
        if user is None or not getattr(user, "is_staff", False) or not user.is_active:
            await self.close(code=NOT_STAFF)
            return
        self._pusher = asyncio.get_running_loop().create_task(self._push(), name="crowdtrain-dashboard-push")

    async def _push(self) -> None:
        while True:
            try:
                # Channels' wrapper closes the thread's connection after the call: a push every few seconds
                # is not the agents' hot path, and no pool thread keeps a connection open after the page closes.
                snapshot: dict[str, Any] = await database_sync_to_async(dashboard.snapshot)()
                await self.send(text_data=json.dumps(snapshot, default=str))
            except asyncio.CancelledError:
                raise
            except Exception:  # the next push tries again; the page keeps showing the last one
                logger.exception("dashboard snapshot failed")
            await asyncio.sleep(settings.CROWDTRAIN_DASHBOARD_PUSH_S)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        pass  # the page only listens

    async def disconnect(self, code: int) -> None:
        if self._pusher is not None:
            self._pusher.cancel()
            self._pusher = None
