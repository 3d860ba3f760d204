"""Wires the aggregator together: one port for uploads and HTTP, one link to the site."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import NegotiationError
from websockets.typing import Subprotocol

from crowdtrain_agent.backoff import Backoff
from crowdtrain_agent.protocol import MAX_WS_MESSAGE_BYTES, SubprotocolError, choose_subprotocol

from .config import WS_LOGGER_NAME, BackboneConfig
from .http_routes import PARAMS_PREFIX, UPLOAD_PATH, make_process_request
from .node import AggregatorNode
from .site_link import SITE_BACKOFF, SiteLink, SiteRefused
from .uploads import UploadHandler

logger = logging.getLogger(__name__)


# What the upload port holds for a client that stops reading or goes quiet. send() waits once
# WRITE_LIMIT_BYTES of replies are buffered for a client that does not read them, so such a
# client stalls only its own upload session and the buffer stays below that plus one reply;
# a keepalive ping goes out every PING_INTERVAL_S, and a client that has not answered it
# within PING_TIMEOUT_S (it reads nothing, or its machine is gone) is dropped. A socket that
# never sends its first upload header is closed after BackboneConfig.header_timeout_s.
PING_INTERVAL_S = 20.0
PING_TIMEOUT_S = 20.0
WRITE_LIMIT_BYTES = 64 << 10  # receipts and rejections are a few hundred bytes each
OPEN_TIMEOUT_S = 10.0  # the HTTP handshake itself (params GETs wait for a version up to PARAMS_WAIT_S inside it)
# A graceful stop waits for the site's orders to go quiet this long (at most DRAIN_LIMIT_S) before
# its last checkpoints: the commit of a step whose uploads it already received arrives within it.
DRAIN_QUIET_S = 1.0
DRAIN_LIMIT_S = 10.0


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _select_subprotocol(_: ServerConnection, offered: Sequence[Subprotocol]) -> Subprotocol | None:
    """The newest protocol minor the agent offers and this aggregator speaks; none offered is a 2.0 agent.

    Raises:
        NegotiationError: for an offer no agent makes; websockets answers HTTP 400 with its reason.
    """
    try:
        chosen, _minor = choose_subprotocol(list(offered))
    except SubprotocolError as exc:
        raise NegotiationError(str(exc)) from None
    return Subprotocol(chosen) if chosen else None


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
        self._server: Server | None = None
        self._link_task: asyncio.Task[None] | None = None
        self.link: SiteLink | None = None

    @property
    def url(self) -> str:
        """``http://HOST:PORT`` this process listens on (the real port, also when 0 was asked)."""
        return f"http://{_url_host(self.config.host)}:{self.port}"

    async def start(self) -> None:
        """Bind the port, then start talking to the site (so the URLs we announce already work)."""
        self._server = await serve(
            UploadHandler(self.node),
            self.config.host,
            self.config.port,
            process_request=make_process_request(self.node),
            select_subprotocol=_select_subprotocol,
            max_size=MAX_WS_MESSAGE_BYTES,
            write_limit=WRITE_LIMIT_BYTES,
            ping_interval=PING_INTERVAL_S,
            ping_timeout=PING_TIMEOUT_S,
            open_timeout=OPEN_TIMEOUT_S,
            compression=None,  # gradients do not compress; deflate would only burn CPU
            logger=logging.getLogger(WS_LOGGER_NAME),
        )
        self.port = self._server.sockets[0].getsockname()[1]
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
        if self._server is not None:
            self._server.close()  # agents with uploads in flight retry them elsewhere or later
            await self._server.wait_closed()
            self._server = None
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
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None


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
