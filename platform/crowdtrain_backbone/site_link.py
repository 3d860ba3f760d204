"""The aggregator's connection to the site (``/ws/backbone/``): hello, heartbeats, orders in, replies out."""

from __future__ import annotations

import asyncio
import logging
import time

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
from websockets.typing import Subprotocol

from crowdtrain_agent.backoff import Backoff
from crowdtrain_agent.protocol import (
    CONNECTION_HEADER,
    HEARTBEAT_INTERVAL_S,
    MAX_WS_MESSAGE_BYTES,
    PROTOCOL_MINOR,
    PROTOCOL_VERSION,
    SITE_TO_BACKBONE,
    UPLOAD_REFUSED_SINCE,
    BackboneHello,
    BackboneWelcome,
    CloseCode,
    ConnectionTries,
    ErrorMessage,
    Heartbeat,
    Message,
    ProtocolError,
    UploadRefused,
    decode_message,
    encode_message,
    negotiated_minor,
    offered_subprotocols,
    should_reconnect,
)

from .config import BackboneConfig
from .node import ORDERS, AggregatorNode, Reply, SiteOrder

logger = logging.getLogger(__name__)

WELCOME_TIMEOUT_S = 10.0
LINK_MESSAGES = (Heartbeat, BackboneWelcome, ErrorMessage)  # taken by the link; the node carries out the rest
# An aggregator is a service: it never gives up on the site, and waits at most 30 s between tries.
SITE_BACKOFF = Backoff(base_s=0.5, max_s=30.0, max_tries=None)


class SiteRefused(RuntimeError):
    """The site closed the backbone connection with a code no retry can fix; the message says what to do."""


class _NotWelcomed(Exception):
    """A connection try that ended before the site's welcome; the message says how."""


def refusal_hint(code: int | None, url: str, name: str) -> str:
    """What the operator reads when the site refuses this aggregator for good (a final close code)."""
    if code == CloseCode.UNAUTHORIZED:
        return (
            f"the site at {url} does not know this aggregator's backbone token (close code {code}). Create one on "
            f"the site with `python manage.py create_backbone_token --name {name}` (add --rotate if that name "
            "exists already) and pass it with --token or CROWDTRAIN_BACKBONE_TOKEN"
        )
    if code == CloseCode.REPLACED:
        return (
            f"another aggregator connected to {url} with this backbone token (close code {code}), and the site "
            "keeps only the newest connection. Run one process per token; for a second aggregator create its own "
            "token with `python manage.py create_backbone_token --name OTHER-NAME`"
        )
    if code == CloseCode.UNSUPPORTED_VERSION:
        return (
            f"the site at {url} speaks another protocol version (close code {code}); upgrade this aggregator and "
            "its crowdtrain-agent package to the site's release"
        )
    return f"the site at {url} closed the backbone connection with code {code}, which no retry can fix"


def _failure(state: RetryCallState) -> str:
    """Why the try tenacity is about to repeat failed."""
    return str(state.outcome.exception()) if state.outcome is not None else "no answer"


class SiteLink:
    """Keeps one connection to the site alive and runs its orders, per campaign, in the order sent.

    Orders of one campaign run one after another (a commit must not overtake
    the assignment before it); different campaigns proceed side by side. The
    queues outlive connections, so a step in progress finishes across a
    reconnect; its reply is lost then, and the site's re-sent commit gets the
    same answer again (commits are idempotent).
    """

    def __init__(
        self,
        config: BackboneConfig,
        node: AggregatorNode,
        *,
        upload_url: str,
        params_url: str,
        backoff: Backoff = SITE_BACKOFF,
    ) -> None:
        self.config = config
        self.node = node
        self.upload_url = upload_url
        self.params_url = params_url
        self.backoff = backoff
        self._ws: ClientConnection | None = None
        self._queues: dict[int, asyncio.Queue[SiteOrder]] = {}
        self._workers: dict[int, asyncio.Task[None]] = {}
        self._busy = 0  # orders being carried out now
        self._last_order = time.monotonic()
        self.connected = asyncio.Event()
        self.minor = PROTOCOL_MINOR  # the protocol minor of the current connection
        self._unknown_noted = False
        self._tries = ConnectionTries()  # so a site acting late on a try given up cannot replace a newer one
        self._telling: set[asyncio.Task[None]] = set()
        node.tell_site = self.tell

    async def run(self) -> None:
        """Connect, serve, reconnect with backoff, until cancelled.

        Raises:
            SiteRefused: the site closed with a code no retry can fix (unknown token, replaced by another
                process with the same token, protocol version); the message says what to do.
        """
        counted = 0  # failed tries of this outage counted already: a welcomed connection that ended is one
        try:
            while True:
                reason = await self._reconnecting(counted)
                counted = 1
                delay = self.backoff.delay(counted)
                self._note_failure(counted, reason, delay)
                await asyncio.sleep(delay)
        finally:
            for task in self._workers.values():
                task.cancel()

    async def _reconnecting(self, counted: int) -> str:
        """Tries until one is welcomed, then that connection's life; returns how it ended.

        Each outage is one tenacity run, so a welcomed connection starts the count
        of failures afresh. The ``n``-th failure of an outage waits ``Backoff.delay(n)``;
        ``counted`` failures came before this run. It never gives up (an aggregator is
        a service, whatever the policy's ``max_tries``).

        Raises:
            SiteRefused: the site closed with a code no retry can fix.
        """
        reason = ""
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(_NotWelcomed),
            wait=lambda state: self.backoff.delay(counted + state.attempt_number),
            before_sleep=lambda state: self._note_failure(
                counted + state.attempt_number, _failure(state), state.upcoming_sleep
            ),
        )
        async for attempt in retrying:
            with attempt:
                reason = await self._one_try(counted + attempt.retry_state.attempt_number - 1)
        return reason

    async def _one_try(self, failures: int) -> str:
        """Connect and, once welcomed, serve until the connection ends; returns how it ended.

        Raises:
            _NotWelcomed: the try ended before the site's welcome.
            SiteRefused: the site closed with a code no retry can fix.
        """
        try:
            ws = await connect(
                self.config.backbone_ws_url,
                additional_headers={
                    "Authorization": f"Bearer {self.config.token}",
                    CONNECTION_HEADER: self._tries.next().header(),
                },
                max_size=MAX_WS_MESSAGE_BYTES,
                open_timeout=WELCOME_TIMEOUT_S,
                subprotocols=[Subprotocol(p) for p in offered_subprotocols()],
            )
        except InvalidStatus as exc:
            # Never the site's verdict on the token (it accepts every socket and refuses a token with
            # close code 4001): daphne answers 403 when too busy to accept in time, proxies 502/503.
            raise _NotWelcomed(f"HTTP {exc.response.status_code}") from None
        except (OSError, TimeoutError, InvalidHandshake) as exc:
            raise _NotWelcomed(f"{type(exc).__name__}: {exc}") from None
        welcomed = await self._serve(ws, failures)
        code = ws.close_code
        if not should_reconnect(code):
            raise SiteRefused(refusal_hint(code, self.config.site, self.config.name))
        if not welcomed:
            raise _NotWelcomed(f"closed with code {code}")
        return f"closed with code {code}"

    def _note_failure(self, failures: int, reason: str, delay: float) -> None:
        """Each failure at DEBUG; the first of an outage also at WARNING, saying the aggregator keeps trying."""
        url = self.config.backbone_ws_url
        logger.debug("site connection to %s failed (%s), try %s; next try in %.1f s", url, reason, failures, delay)
        if failures == 1:
            logger.warning(
                "the site at %s is busy or unreachable (%s); retrying with growing pauses of up to %.0f s",
                url,
                reason,
                self.backoff.max_s,
            )

    async def _serve(self, ws: ClientConnection, failures: int) -> bool:
        """Say hello, wait for the welcome, then take orders until the connection closes.

        Returns:
            Whether the site welcomed us (a connection that never got that far counts as a failed try).
        """
        try:
            try:
                self.minor = negotiated_minor(ws.subprotocol)
                self.node.site_minor = self.minor
                hello = BackboneHello(
                    protocol_version=PROTOCOL_VERSION,
                    name=self.config.name,
                    upload_url=self.upload_url,
                    params_url=self.params_url,
                )
                await ws.send(encode_message(hello, self.minor))
                async with asyncio.timeout(WELCOME_TIMEOUT_S):
                    raw = await ws.recv()
                welcome = decode_message(raw, allowed=(BackboneWelcome,), unknown=self._note_unknown)
                ticket_key = bytes.fromhex(welcome.ticket_key)
            except (ProtocolError, ValueError, TimeoutError) as exc:
                logger.warning("the site's answer to our hello is not a welcome (%s); retrying", exc)
                return False
            except ConnectionClosed:
                return False
            self.node.ticket_key = ticket_key
            self.node.aggregator_id = welcome.aggregator_id
            if failures:
                logger.info("reconnected to the site after %s tries (aggregator %s)", failures, welcome.aggregator_id)
            else:
                logger.info("connected to the site as aggregator %s (%s)", welcome.aggregator_id, self.config.name)
            self._ws = ws
            self.connected.set()
            interval = welcome.heartbeat_s if welcome.heartbeat_s > 0 else HEARTBEAT_INTERVAL_S
            heartbeats = asyncio.create_task(self._heartbeat(ws, interval))
            # Its own task: a write to a store that is down can take seconds, and heartbeats must not wait.
            retries = asyncio.create_task(self._retry_checkpoints(interval))
            try:
                async for raw in ws:
                    self._dispatch(raw)
            except ConnectionClosed:
                pass
            finally:
                heartbeats.cancel()
                retries.cancel()
                self._ws = None
                self.connected.clear()
            return True
        finally:
            # A plain close (1000) also when cancelled: the site must not read a stop as a crash.
            await ws.close()

    async def _heartbeat(self, ws: ClientConnection, interval: float) -> None:
        beat = encode_message(Heartbeat())
        try:
            while True:
                await asyncio.sleep(interval)
                await ws.send(beat)
        except ConnectionClosed:
            return

    async def _retry_checkpoints(self, interval: float) -> None:
        """Write refused checkpoints again (``AggregatorNode.retry_checkpoints``) and confirm those the store took."""
        while True:
            await asyncio.sleep(interval)
            try:
                replies = await self.node.retry_checkpoints()
            except Exception:  # a bug here must not end the retries for good
                logger.exception("retrying refused checkpoints failed")
                continue
            for reply in replies:
                await self.send(reply)

    def _dispatch(self, raw: str | bytes) -> None:
        try:
            message = decode_message(raw, allowed=SITE_TO_BACKBONE, unknown=self._note_unknown)
        except ProtocolError as exc:
            logger.warning("ignoring a bad message from the site: %s", exc)
            return
        if isinstance(message, (Heartbeat, BackboneWelcome)):  # LINK_MESSAGES: the link's own
            return
        if isinstance(message, ErrorMessage):
            logger.warning("the site reports an error (%s): %s", message.code, message.detail)
            return
        if not isinstance(message, ORDERS):  # SITE_TO_BACKBONE is LINK_MESSAGES and ORDERS; a test keeps it so
            logger.error("no handler for %r: add it to LINK_MESSAGES or ORDERS", message.kind)
            return
        campaign_id = message.campaign_id
        if campaign_id not in self._queues:
            self._queues[campaign_id] = asyncio.Queue()
            self._workers[campaign_id] = asyncio.create_task(self._work(self._queues[campaign_id]))
        self._last_order = time.monotonic()
        self._queues[campaign_id].put_nowait(message)

    async def _work(self, queue: asyncio.Queue[SiteOrder]) -> None:
        while True:
            order = await queue.get()
            self._busy += 1
            try:
                replies = await self.node.handle(order)
            except Exception as exc:
                # Answered all the same: a site that hears nothing re-sends a commit on every heartbeat
                # and the organizer sees only a stall.
                logger.exception("failed to carry out %s for campaign %s", order.kind, order.campaign_id)
                replies = self.node.failure_replies(order, exc)
            finally:
                self._busy -= 1
            for reply in replies:
                await self.send(reply)

    async def drain(self, quiet_s: float, limit_s: float) -> bool:
        """Wait until no order is in hand and none came for ``quiet_s`` (at most ``limit_s``).

        A stopping aggregator calls this after it stopped taking uploads: a
        commit for the step in hand, made of uploads it already received, is
        applied rather than lost.

        Returns:
            Whether it went quiet within the limit.
        """
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            idle = self._busy == 0 and all(q.empty() for q in self._queues.values())
            if idle and time.monotonic() - self._last_order >= quiet_s:
                return True
            await asyncio.sleep(0.05)
        return False

    def tell(self, message: Message) -> None:
        """Send ``message`` soon, from code that cannot wait (``AggregatorNode.tell_site``); lost if not connected.

        Only to a site that takes it: an older one answers a kind it does not know with errors.
        """
        if isinstance(message, UploadRefused) and self.minor < UPLOAD_REFUSED_SINCE:
            return
        task = asyncio.get_running_loop().create_task(self.send(message))
        self._telling.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._telling.discard)

    async def send(self, reply: Reply | Message) -> None:
        """Send a reply if connected; a lost reply is recovered by the site's re-sent order."""
        ws = self._ws
        if ws is None:
            logger.debug("not connected; dropping %s", reply)
            return
        try:
            await ws.send(encode_message(reply, self.minor))
        except ConnectionClosed:
            logger.debug("connection closed; dropping %s", reply)

    def _note_unknown(self, kind: str, fields: list[str]) -> None:
        """A newer site sends fields this aggregator does not know: ignored, and said once per process."""
        if not self._unknown_noted:
            self._unknown_noted = True
            logger.info(
                "the site sends fields this aggregator does not know (%s: %s); upgrade it to use them",
                kind,
                ", ".join(fields[:5]),
            )
