"""The control channel to the site: hello, heartbeats, request/reply calls, pushes, reconnects."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, retry_if_exception_type, stop_after_attempt
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
from websockets.typing import Subprotocol

from .backoff import Backoff  # also reached as control.Backoff (runtime, tests, load generator)
from .protocol import (
    CONNECTION_HEADER,
    HEARTBEAT_INTERVAL_S,
    MAX_WS_MESSAGE_BYTES,
    PROTOCOL_MINOR,
    SITE_TO_AGENT,
    AgentHello,
    CloseCode,
    ConnectionTries,
    ControlsChanged,
    DoneAck,
    ErrorMessage,
    Heartbeat,
    Lease,
    LeaseRelease,
    NoLease,
    ProtocolError,
    ReleaseAck,
    VersionPublished,
    Welcome,
    decode_message,
    encode_message,
    negotiated_minor,
    offered_subprotocols,
    should_reconnect,
)

logger = logging.getLogger(__name__)

# The websockets library's own keepalive: a ping every PING_INTERVAL_S, and a site that has not
# answered within PING_TIMEOUT_S is taken for gone (the connection is closed and retried). It finds a
# site that vanished without closing TCP (a half-open connection); a site that dies closes the socket
# and is noticed at once. Not the library's 20 s: the heartbeats already keep the socket busy, and a
# ping per heartbeat doubled what every idle volunteer cost the site.
PING_INTERVAL_S = 60.0
PING_TIMEOUT_S = 30.0
REFUSAL_CLOSE_WAIT_S = 5.0  # after an error frame in place of the welcome, for the close that says why


class ConnectionLost(ConnectionError):
    """The control connection dropped before the reply arrived; the channel is reconnecting."""


class AgentStopped(RuntimeError):
    """The site refused this agent for good (or could not be reached); the message says what to do."""


class _NotWelcomed(Exception):
    """A connection try that ended before the site's welcome, with its close code (None: no close frame)."""

    def __init__(self, code: int | None) -> None:
        super().__init__(f"the connection ended before the welcome (close code {code})")
        self.code = code


def _worth_another_try(exc: BaseException) -> bool:
    """A try that was not welcomed goes on, unless its close code says no retry can help."""
    return isinstance(exc, _NotWelcomed) and should_reconnect(exc.code)


def close_hint(code: int, url: str, reason: str = "") -> str:
    """The message a volunteer sees when the site closed with a code no retry can fix, and the site's reason."""
    hint = _close_hint(code, url)
    return f"{hint} (the site said: {reason})" if reason else hint


def _close_hint(code: int, url: str) -> str:
    if code == CloseCode.UNAUTHORIZED:
        return (
            f"the site at {url} rejected this agent's token (close code {code}); log in again, or check the "
            "token given with --token, CROWDTRAIN_AGENT_TOKEN or the saved config file"
        )
    if code == CloseCode.REVOKED:
        return (
            f"this device was revoked in the browser (close code {code}); log in again to register it as a "
            "new device if that was a mistake"
        )
    if code == CloseCode.UNSUPPORTED_VERSION:
        return f"the site speaks a newer protocol (close code {code}); upgrade: pip install -U crowdtrain-agent"
    if code == CloseCode.REPLACED:
        return (
            f"another agent connected with this device's token (close code {code}); run one agent per device "
            "token, or log in again on the second machine"
        )
    return f"the site closed the control connection with code {code}"


# How the channel takes each kind the site sends (SITE_TO_AGENT): the welcome ends the handshake,
# replies go to the request that waits for them, pushes to the agent's on_push.
REPLIES = (Lease, NoLease, DoneAck, ReleaseAck)
PUSHES = (VersionPublished, ErrorMessage, ControlsChanged)


def _reply_slot(message: Any) -> str | None:
    if isinstance(message, (Lease, NoLease)):
        return "lease"
    if isinstance(message, DoneAck):
        return f"done:{message.lease_id}"
    if isinstance(message, ReleaseAck):
        return f"release:{message.lease_id}"
    return None


class ControlChannel:
    """A self-healing connection to the site's ``/ws/agent/`` endpoint.

    One reader task owns the socket's incoming side. Replies go to the waiter
    that asked for them (keyed by reply slot: ``lease``, ``done:<id>``,
    ``release:<id>``); pushes (new versions, errors) go to ``on_push``. When
    the connection drops, waiters fail with ConnectionLost and the channel
    reconnects with exponential backoff plus jitter, unless the close code
    says no retry can help (bad token, revoked device, old agent, replaced by
    another agent on the same token). The site refuses a token only with a
    close code after accepting the socket, so an HTTP error on the handshake
    (403 from a busy daphne, 502/503 from a proxy) is retried like a timeout.

    Args:
        url: ws:// or wss:// URL of the control endpoint.
        token: device API token, sent as a Bearer header on every connect.
        hello: the AgentHello sent first on every connection.
        on_push: called on the event loop for VersionPublished, ErrorMessage and ControlsChanged.
        on_state: called with a short status text when the connection goes up or down.
        backoff: reconnect policy.
    """

    def __init__(
        self,
        url: str,
        token: str,
        hello: AgentHello,
        *,
        on_push: Callable[[Any], None] = lambda message: None,
        on_state: Callable[[str], None] = lambda text: None,
        backoff: Backoff | None = None,
    ) -> None:
        self.url = url
        self._token = token
        self._hello = hello
        self._on_push = on_push
        self._on_state = on_state
        self._backoff = backoff or Backoff()
        self._ws: ClientConnection | None = None
        self._ready = asyncio.Event()  # set while connected and welcomed, or once fatal
        self._closing = False
        self._waiters: dict[str, asyncio.Future[Any]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self.fatal: AgentStopped | None = None
        self.welcome: Welcome | None = None
        self.connections = 0
        self.minor = PROTOCOL_MINOR  # the protocol minor of the current connection
        self._unknown_noted = False
        self._close_reason = ""  # the reason of the last close frame or refusal, for the volunteer
        self._tries = ConnectionTries()  # so a site acting late on a try given up cannot replace a newer one

    # ------------------------------------------------------------ public calls

    async def call(self, message: Any, slot: str, *, timeout: float = 30.0, retries: int = 0) -> Any:
        """Send ``message`` and wait for the reply that lands in ``slot``.

        Args:
            message: a request dataclass (LeaseRequest, LeaseDone, LeaseRelease).
            slot: the reply slot (see _reply_slot).
            timeout: seconds to wait for the reply once sent.
            retries: how many times to send again after a dropped connection.

        Raises:
            AgentStopped: if the channel failed for good.
            ConnectionLost: if the connection dropped more than ``retries`` times.
            TimeoutError: if no reply came within ``timeout``.
        """
        resending = AsyncRetrying(
            retry=retry_if_exception_type(ConnectionLost),
            stop=stop_after_attempt(retries + 1),
            before_sleep=lambda state: logger.debug(
                "connection lost waiting for %s; sending again after reconnect", slot
            ),
            reraise=True,
        )
        return await resending(self._call_once, message, slot, timeout)

    async def _call_once(self, message: Any, slot: str, timeout: float) -> Any:
        """Send ``message`` once on the current connection and wait for its reply; ConnectionLost if it drops."""
        ws = await self._connected()
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiters[slot] = future
        try:
            try:
                await ws.send(encode_message(message))
            except ConnectionClosed:
                raise ConnectionLost("control connection closed while sending") from None
            return await asyncio.wait_for(future, timeout)
        finally:
            if self._waiters.get(slot) is future:
                del self._waiters[slot]

    async def send(self, message: Any) -> None:
        """Send without waiting for a reply; dropped silently if disconnected."""
        ws = self._ws
        if ws is not None:
            try:
                await ws.send(encode_message(message, self.minor))
            except ConnectionClosed:
                pass

    def _note_unknown(self, kind: str, fields: list[str]) -> None:
        """A newer site sends fields this agent does not know: ignored, and said once per connection."""
        if not self._unknown_noted:
            self._unknown_noted = True
            logger.info(
                "the site sends fields this agent does not know (%s: %s); it still works, and an upgrade "
                "(pip install -U crowdtrain-agent) will use them",
                kind,
                ", ".join(fields[:5]),
            )

    async def close(self) -> None:
        """Close for good; run() returns."""
        self._closing = True
        if self._ws is not None:
            await self._ws.close()

    # ----------------------------------------------------------- connection

    async def run(self) -> None:
        """Connect, and reconnect after every drop, until close() or a fatal close code.

        Each outage is one tenacity run of connection tries (``_reconnecting``):
        a welcomed connection ends it, so the next drop starts a fresh count of
        tries, and the first try after a drop waits the policy's first pause.

        Raises:
            AgentStopped: for a close code no retry can fix, or after Backoff.max_tries failures.
        """
        dropped = False  # a welcomed connection ended: the next try waits first
        while not self._closing:
            if dropped:
                self._on_state("reconnecting to the site (try 1)")
                await asyncio.sleep(self._backoff.delay(1))
                if self._closing:
                    return
            try:
                code = await self._reconnecting()
            except _NotWelcomed as exc:
                code = exc.code  # a close code no retry can fix (see _worth_another_try)
            if self._closing:
                return
            if not should_reconnect(code):
                self._fail(AgentStopped(close_hint(int(code or 0), self.url, self._close_reason)))
                raise self.fatal  # type: ignore[misc]
            dropped = True

    async def _reconnecting(self) -> int | None:
        """Tries until one is welcomed, then that connection's life; returns its close code (None: closing).

        Try ``n`` that failed waits ``Backoff.delay(n + 1)``: the pause before try 1
        is the one after a drop (``run``).

        Raises:
            _NotWelcomed: a try ended with a close code no retry can fix.
            AgentStopped: after Backoff.max_tries tries in a row failed.
        """
        code: int | None = None
        retrying = AsyncRetrying(
            retry=retry_if_exception(_worth_another_try),
            wait=lambda state: self._backoff.delay(state.attempt_number + 1),
            stop=self._stop_trying,
            before_sleep=lambda state: self._on_state(f"reconnecting to the site (try {state.attempt_number + 1})"),
            retry_error_callback=self._give_up,
        )
        async for attempt in retrying:
            with attempt:
                code = await self._one_try(attempt.retry_state.attempt_number)
        return code

    def _stop_trying(self, state: RetryCallState) -> bool:
        return self._closing or self._backoff.stop()(state)

    def _give_up(self, state: RetryCallState) -> None:
        """The last try allowed failed (or close() was called meanwhile: then nothing to say)."""
        if self._closing:
            return
        tries = state.attempt_number
        logger.warning("giving up on %s after %d tries", self.url, tries)
        self._fail(
            AgentStopped(
                f"could not reach the site at {self.url} after {tries} tries; check the network and the "
                "--server address, then start the agent again"
            )
        )
        raise self.fatal  # type: ignore[misc]

    async def _one_try(self, tries: int) -> int | None:
        """Connection try number ``tries`` and, once welcomed, that connection's life; returns its close code.

        Raises:
            _NotWelcomed: the try ended before the site's welcome.
        """
        code: int | None = None
        try:
            code = await self._connect_once(tries)
        except InvalidStatus as exc:
            # An HTTP answer to the handshake is never the site's verdict on this agent: the site accepts
            # every socket and refuses a token with a close code. daphne answers 403 to a handshake it was
            # too busy to accept in time, and proxies answer 502/503 while the site restarts: try again.
            self._note_busy(tries, f"HTTP {exc.response.status_code}")
        except (OSError, TimeoutError, InvalidHandshake, ConnectionClosed, ProtocolError) as exc:
            rcvd = getattr(exc, "rcvd", None)  # a real close frame, if one came
            code, self._close_reason = getattr(rcvd, "code", None), getattr(rcvd, "reason", "")
            if should_reconnect(code):
                self._note_busy(tries, f"{type(exc).__name__}: {exc}")
        if self.welcome is None:
            raise _NotWelcomed(code)
        return code

    def _note_busy(self, tries: int, reason: str) -> None:
        """Log a failed connection try: each at DEBUG, and once per outage a line that says it goes on."""
        logger.debug("connect try %d to %s failed: %s", tries, self.url, reason)
        if tries == 1:
            logger.warning(
                "the site at %s is busy or unreachable (%s); the agent keeps trying, with growing pauses of up "
                "to %.0f s",
                self.url,
                reason,
                self._backoff.max_s,
            )

    async def _connect_once(self, attempt: int) -> int | None:
        """One connection's life; returns the close code (None if the TCP connection just dropped)."""
        self.welcome = None
        async with connect(
            self.url,
            additional_headers={
                "Authorization": f"Bearer {self._token}",
                CONNECTION_HEADER: self._tries.next().header(),
            },
            max_size=MAX_WS_MESSAGE_BYTES,
            open_timeout=10,
            ping_interval=PING_INTERVAL_S,
            ping_timeout=PING_TIMEOUT_S,
            subprotocols=[Subprotocol(p) for p in offered_subprotocols()],
        ) as ws:
            self.minor = negotiated_minor(ws.subprotocol)  # 0: a site from before minors were negotiated
            self._unknown_noted = False
            await ws.send(encode_message(self._hello, self.minor))
            raw = await asyncio.wait_for(ws.recv(), 15)
            first = decode_message(raw, allowed=SITE_TO_AGENT, unknown=self._note_unknown)
            if isinstance(first, ErrorMessage):
                # A refusal: the site closes next, and its close code says whether another try can help.
                logger.warning("the site refused this connection: %s (%s)", first.code, first.detail)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ws.wait_closed(), REFUSAL_CLOSE_WAIT_S)
                return self._closed_with(ws, first.detail)
            if not isinstance(first, Welcome):
                raise ProtocolError(f"expected a welcome from the site, got {first!r}")
            self.welcome = first
            self.connections += 1
            if self.connections > 1:
                logger.info("reconnected after %d tries", attempt)
            logger.debug("connected as device %d (%s) of %s", first.device_id, first.device_name, first.volunteer)
            self._on_state("connected")
            self._ws = ws
            self._ready.set()
            interval = first.heartbeat_s if first.heartbeat_s > 0 else HEARTBEAT_INTERVAL_S
            heartbeat = asyncio.create_task(self._heartbeat(ws, interval), name="crowdtrain-heartbeat")
            try:
                await self._read(ws)
            finally:
                heartbeat.cancel()
                self._ws = None
                self._ready.clear()
                self._fail_waiters(ConnectionLost("control connection lost"))
                if not self._closing:
                    self._on_state("disconnected from the site")
        return self._closed_with(ws)

    def _closed_with(self, ws: ClientConnection, said: str = "") -> int | None:
        """The close code of a connection that ended (None: the TCP connection just dropped); notes its reason."""
        code = ws.close_code
        self._close_reason = ws.close_reason or said
        logger.debug("control connection closed with code %s", code)
        return None if code in (None, 1006) else code

    async def _read(self, ws: ClientConnection) -> None:
        """Dispatch every incoming message until the connection closes."""
        try:
            async for raw in ws:
                try:
                    message = decode_message(raw, allowed=SITE_TO_AGENT, unknown=self._note_unknown)
                except ProtocolError as exc:
                    logger.warning("ignoring a malformed message from the site: %s", exc)
                    continue
                self._dispatch(message)
        except ConnectionClosed:
            pass

    def _dispatch(self, message: Any) -> None:
        slot = _reply_slot(message)
        if slot is not None:
            waiter = self._waiters.get(slot)
            if waiter is not None and not waiter.done():
                waiter.set_result(message)
            elif isinstance(message, Lease):
                # Nobody waits any more (timed out, stopping): give it back instead of letting it expire.
                logger.debug("unrequested lease %d; releasing it", message.lease_id)
                task = asyncio.get_running_loop().create_task(self.send(LeaseRelease(lease_id=message.lease_id)))
                self._background.add(task)  # the loop keeps only weak references to tasks
                task.add_done_callback(self._background.discard)
            else:
                logger.debug("dropping a reply nobody waits for: %s", message)
            return
        if isinstance(message, ErrorMessage):
            logger.warning("the site rejected a message: %s (%s)", message.code, message.detail)
        self._on_push(message)

    async def _heartbeat(self, ws: ClientConnection, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await ws.send(encode_message(Heartbeat()))
            except ConnectionClosed:
                return

    async def welcomed(self) -> None:
        """Return once connected and welcomed (the welcome carries the device's settings).

        Raises:
            AgentStopped: if the site closed for good.
        """
        await self._connected()

    async def _connected(self) -> ClientConnection:
        while True:
            if self.fatal is not None:
                raise self.fatal
            if self._ws is not None:
                return self._ws
            await self._ready.wait()

    def _fail(self, error: AgentStopped) -> None:
        self.fatal = error
        self._fail_waiters(error)
        self._ready.set()  # wake callers blocked in _connected so they see the error

    def _fail_waiters(self, error: BaseException) -> None:
        for future in self._waiters.values():
            if not future.done():
                future.set_exception(error)
