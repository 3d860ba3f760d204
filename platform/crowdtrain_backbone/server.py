"""Wires the aggregator together: one port for uploads and HTTP, one link to the site."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiohttp import web

from crowdtrain_agent.backoff import Backoff

from .config import WS_LOGGER_NAME, BackboneConfig
from .http_routes import PARAMS_PREFIX, READ_HEADER_BYTES, UPLOAD_PATH, add_cors_headers, make_router
from .node import AggregatorNode
from .site_link import SITE_BACKOFF, SiteLink, SiteRefused
from .uploads import UploadHandler

logger = logging.getLogger(__name__)


# How long an HTTP connection may idle between requests before the server closes it. Agents download
# every step's parameters on the connection they keep; a step rarely takes longer than this.
KEEPALIVE_S = 75.0
# How long a stop waits for requests in flight (a download waiting for its version) before cancelling them.
SHUTDOWN_WAIT_S = 1.0
# A graceful stop waits for the site's orders to go quiet this long (at most DRAIN_LIMIT_S) before
# its last checkpoints: the commit of a step whose uploads it already received arrives within it.
DRAIN_QUIET_S = 1.0
DRAIN_LIMIT_S = 10.0


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class BackboneServer:
    """A running aggregator: the listening socket, its state, and the site link.

    Tests use it directly (``await server.start()`` ... ``await server.stop()``);
    the CLI goes through ``run``.
    """

    def __init__(self, config: BackboneConfig, *, backoff: Backoff = SITE_BACKOFF) -> None:
        self.config = config
        self.node = AggregatorNode(config)
        self.port = 0
        self._backoff = backoff  # between tries to reach the site
        self._runner: web.AppRunner | None = None
        self._link_task: asyncio.Task[None] | None = None
        self.link: SiteLink | None = None

    @property
    def url(self) -> str:
        """``http://HOST:PORT`` this process listens on (the real port, also when 0 was asked)."""
        return f"http://{_url_host(self.config.host)}:{self.port}"

    async def start(self) -> None:
        """Bind the port, then start talking to the site (so the URLs we announce already work)."""
        uploads = UploadHandler(self.node)
        app = web.Application(handler_args={"max_field_size": READ_HEADER_BYTES})
        app.router.add_route("*", "/{path:.*}", make_router(self.node, uploads))
        app.on_response_prepare.append(add_cors_headers)
        app.on_shutdown.append(uploads.close_all)
        runner = web.AppRunner(
            app,
            access_log=None,  # an agent downloads every step: one line each would flood the log
            logger=logging.getLogger(WS_LOGGER_NAME),
            keepalive_timeout=KEEPALIVE_S,
            shutdown_timeout=SHUTDOWN_WAIT_S,
        )
        await runner.setup()
        site = web.TCPSite(runner, self.config.host, self.config.port)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = runner.addresses[0][1]
        public = f"{_url_host(self.config.public_host)}:{self.port}"
        self.link = SiteLink(
            self.config,
            self.node,
            upload_url=f"ws://{public}{UPLOAD_PATH}",
            params_url=f"http://{public}{PARAMS_PREFIX}",
            backoff=self._backoff,
        )
        self._link_task = asyncio.create_task(self.link.run())
        logger.info("aggregator %s listening on %s, site %s", self.config.name, self.url, self.config.site)

    async def wait(self) -> None:
        """Until the task is cancelled.

        Raises:
            SiteRefused: the site refused this aggregator for good (see ``SiteLink.run``).
        """
        if self._link_task is not None:
            await self._link_task

    async def shutdown(self) -> int:
        """Stop gracefully: take no more uploads, apply the commits on their way, checkpoint every slice, tell the site.

        The checkpoints carry the uploads no commit has named yet, so the step
        in hand is committed by the restarted process (or a replacement given
        the same storage) rather than redone.

        Returns:
            How many slices have a confirmed checkpoint of their current version.
        """
        if self._runner is not None:
            await self._runner.cleanup()  # agents with uploads in flight retry them elsewhere or later
            self._runner = None
        saved = []
        if self.link is not None:
            if not await self.link.drain(DRAIN_QUIET_S, DRAIN_LIMIT_S):
                logger.warning("the site kept sending orders for %.0f s; checkpointing anyway", DRAIN_LIMIT_S)
            saved = await self.node.checkpoint_all()
            for reply in saved:
                await self.link.send(reply)
        kept = sum(len(s.pending) for s in self.node.slices.values())
        logger.info(
            "stopping: %s slice checkpoint(s) of the current version written and reported, with %s pending upload(s)",
            len(saved),
            kept,
        )
        await self.stop()
        return len(saved)

    async def stop(self) -> None:
        """Close the site link and the listening socket; pending uploads are lost (they are not durable)."""
        if self._link_task is not None:
            self._link_task.cancel()
            try:
                await self._link_task
            except (asyncio.CancelledError, SiteRefused):
                pass  # a refusal reached the caller through wait() already
            self._link_task = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


async def run(
    config: BackboneConfig, on_listening: Callable[[str], None] | None = None, stop: asyncio.Event | None = None
) -> int:
    """Run the aggregator until ``stop`` is set (a graceful stop), cancelled, or refused by the site.

    Args:
        config: the frozen config.
        on_listening: called once with ``http://HOST:PORT`` after the port is bound.
        stop: set it to stop gracefully (``BackboneServer.shutdown``); cancelling stops at once.

    Returns:
        The process exit code, 0.

    Raises:
        SiteRefused: the site refused this aggregator for good; the message says what to do.
    """
    server = BackboneServer(config)
    await server.start()
    if on_listening is not None:
        on_listening(server.url)
    stop = stop if stop is not None else asyncio.Event()
    stopping = asyncio.create_task(stop.wait())
    linked = asyncio.create_task(server.wait())
    try:
        await asyncio.wait({stopping, linked}, return_when=asyncio.FIRST_COMPLETED)
        if linked.done():
            linked.result()  # a refusal raises here
            return 0
        await server.shutdown()
        return 0
    finally:
        stopping.cancel()
        await server.stop()
