"""WebSocket endpoints: the agents' control channel and the aggregators' backbone channel."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict

import msgspec
from channels.consumer import get_handler_name
from channels.db import database_sync_to_async
from channels.exceptions import ChannelFull
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from django.db import DatabaseError
from django.utils import timezone
from redis.exceptions import RedisError

from crowdtrain.accounts.models import Device
from crowdtrain.accounts.names import account_name
from crowdtrain.accounts.tokens import bearer_token
from crowdtrain.devices.actions import device_controls, stored_controls
from crowdtrain.devices.activity import Tracker
from crowdtrain.lib.metrics import LEASE_REQUEST_SECONDS
from crowdtrain.lib.offloop import offloop
from crowdtrain.ops import heartbeats
from crowdtrain.periodic import LAST_SEEN_DB_EVERY_S
from crowdtrain.scheduler import backbone, browser_tabs, endings, leasing, parking, reporting
from crowdtrain.scheduler.hotstate import hot_state, presence
from crowdtrain.scheduler.models import Aggregator
from crowdtrain.verification import checks, refusals, standing
from crowdtrain.verification.affinity import client_address, network_prefix
from crowdtrain_agent.protocol import (
    AGENT_TO_SITE,
    BACKBONE_TO_SITE,
    CONTROLS_PUSHED_SINCE,
    OLDEST_MINOR,
    PROTOCOL_MINOR,
    PROTOCOL_VERSION,
    AgentHello,
    BackboneHello,
    BackboneWelcome,
    CheckpointSaved,
    CloseCode,
    ControlsChanged,
    DeviceInfo,
    ErrorMessage,
    Heartbeat,
    Lease,
    LeaseDone,
    LeaseRelease,
    LeaseRequest,
    Message,
    NoLease,
    Paused,
    ProtocolError,
    ReleaseAck,
    SliceLost,
    SliceReady,
    StepApplied,
    StepFailed,
    SubprotocolError,
    UploadRefused,
    Welcome,
    choose_subprotocol,
    close_reason,
    decode_message,
    encode_message,
    offered_bearer,
)
from crowdtrain_agent.protocol.schema import lost_in

from .admission import admission
from .backbone_lane import subscriber
from .groups import memberships
from .housekeeping import housekeeping
from .outbox import (
    ControlsEvent,
    ReplacedEvent,
    RevokedEvent,
    SendEvent,
    backbone_group,
    campaign_agents_group,
    device_group,
    publish_commits,
    replace_connections,
    send_commits,
    send_outbox,
    send_to_group,
    wake,
)
from .tries import connection_try, may_take_over

logger = logging.getLogger(__name__)

# A peer that keeps sending bad messages is cut off; a few mistakes are answered and forgiven.
MAX_ERRORS = 20
MAX_WATCHED_CAMPAIGNS = 16  # campaigns one connection hears version pushes of
LAST_SEEN_EVERY_S = 60.0  # an aggregator's heartbeats reach the database this seldom
# A site process this busy gives no backups of late leases: its own backlog is what makes them late.
BACKUPS_BELOW_LOAD = 0.5
POST_AGAIN_S = 0.5  # a timer's event that met a full inbox is sent again this much later

_HEARTBEAT = encode_message(Heartbeat())  # what every agent sends, byte for byte
_ERROR_CODES: dict[int, str] = {
    CloseCode.TOO_LARGE: "too large",
    CloseCode.BAD_TICKET: "bad ticket",
    CloseCode.UNSUPPORTED_VERSION: "unsupported version",
}


class HelloDeadlineEvent(TypedDict):
    type: str  # "hello.deadline": the socket's time to say hello is up


class _ProtocolConsumer(AsyncWebsocketConsumer):
    """Shared parts: strict decoding, error replies, closing, the hello deadline, one socket per peer.

    Both channels accept the socket first and authenticate after (see
    ``AgentConsumer.connect``); a peer then has ``CROWDTRAIN_HELLO_TIMEOUT_S``
    to say hello, or the socket is closed with 4000: an idle socket that never
    speaks must not hold a connection slot for ever.
    """

    accepts: tuple[type[Message], ...] = ()
    errors = 0
    greeted = False
    other_major = False  # the hello named another major: refused with the close alone (``reject``)
    minor = 0  # the protocol minor negotiated with the peer (0: it offered none, a 2.0 peer)
    unknown_logged = False
    closed = False  # once we closed: frames still on their way are dropped, events ignored
    _hello_timer: asyncio.TimerHandle | None = None

    async def dispatch(self, message: dict[str, Any]) -> None:
        """Channels' dispatch without its ``aclose_old_connections`` before every message.

        That call is a hop to the one database thread for each frame and event (a
        heartbeat, a lease request, a wake), queued behind every other socket's: with
        thousands of volunteers it was much of the site's cost. Our handlers reach the
        database only through ``database_sync_to_async`` or ``offloop``, which look
        after their connections themselves.
        """
        handler = getattr(self, get_handler_name(message), None)
        if handler is None:
            raise ValueError(f"no handler for message type {message['type']}")
        await handler(message)

    async def close(self, code: int | None = None, reason: str | None = None) -> None:
        """Close the socket; every close of both consumers goes through here.

        The code goes out as a plain ``int``: daphne hands it to autobahn,
        which refuses any other type, ``CloseCode`` members included ("invalid
        type ... for close code (must be an integer)"); the consumer then died
        and the peer saw 1011 instead of the protocol's code.
        """
        self.closed = True
        self._stop_hello_deadline()
        await super().close(code=None if code is None else int(code), reason=reason)

    async def websocket_disconnect(self, message: dict[str, Any]) -> None:
        self.closed = True  # the peer's close: timers that would post to this consumer stop
        self._stop_hello_deadline()
        await super().websocket_disconnect(message)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if self.closed:
            return  # e.g. a hello that arrived while the token of a refused socket was looked up
        if text_data is None:
            await self.reject(ProtocolError("binary frames are not accepted on this channel; send JSON text"))
            return
        try:
            message = decode_message(text_data, self.accepts, unknown=self.note_unknown)
            if not self.greeted and message.kind not in {"hello", "backbone_hello"}:
                raise ProtocolError(f"send hello before {message.kind!r}")
            await getattr(self, f"on_{message.kind}")(message)
        except ProtocolError as exc:
            await self.reject(exc)

    async def reject(self, exc: ProtocolError) -> None:
        self.errors += 1
        if exc.fatal and exc.close_code == CloseCode.UNSUPPORTED_VERSION and self.other_major:
            # The close alone, its reason saying what to do: an agent of an older major (1.x) takes any
            # frame in place of its welcome for a failed connect and retries for 25 minutes, while every
            # agent ever released stops on 4004 and prints its upgrade hint (agent/PROTOCOL.md).
            logger.info("%s: refused: %s", self.__class__.__name__, exc)
            await self.close(code=exc.close_code, reason=close_reason(str(exc)))
            return
        code = _ERROR_CODES.get(exc.close_code, "bad message")
        await self.send(text_data=encode_message(ErrorMessage(code=code, detail=str(exc))))
        logger.info("%s: rejected message: %s", self.__class__.__name__, exc)
        if exc.fatal:
            await self.close(code=exc.close_code, reason=close_reason(str(exc)))
        elif self.errors > MAX_ERRORS:
            await self.close(code=CloseCode.TOO_MANY_ERRORS)

    async def accept_protocol(self) -> bool:
        """Accept the socket with the newest protocol minor both sides speak (the WebSocket subprotocol).

        An offer no client of ours makes is accepted only to be closed with 4004
        and the reason (daphne refuses most with HTTP 400 before this runs:
        ``daphne_site.SiteWebSocketProtocol``). Returns whether the socket stays.
        """
        offered = self.scope.get("subprotocols") or []
        try:
            chosen, self.minor = choose_subprotocol(list(offered), settings.CROWDTRAIN_PROTOCOL_MINOR)
        except SubprotocolError as exc:
            logger.info("%s: refused a handshake: %s", self.__class__.__name__, exc)
            await self.accept()
            await self.close(code=exc.close_code, reason=close_reason(str(exc)))
            return False
        await self.accept(subprotocol=chosen)
        return True

    def note_unknown(self, kind: str, fields: list[str]) -> None:
        """Fields of a newer minor are ignored; said once per connection, so an operator knows who is ahead."""
        if not self.unknown_logged:
            self.unknown_logged = True
            logger.info(
                "%s: ignoring fields this site does not know (first: %s %s); the peer speaks a newer protocol minor",
                self.__class__.__name__,
                kind,
                ", ".join(fields[:5]),
            )

    async def send_message(self, message: Any) -> None:
        await self.send(text_data=encode_message(message, self.minor))

    async def socket_send(self, event: SendEvent) -> None:
        if self.closed:
            logger.debug("%s: not sent, the socket is closing: %.80s", self.__class__.__name__, event.get("text", ""))
            return
        unsendable = event.get("unsendable")
        if unsendable and str(self.minor) in unsendable:
            # It would read the message without those fields and act on something else (a campaign's
            # weight decay, say): it must be upgraded instead.
            detail = (
                f"protocol {PROTOCOL_VERSION}.{self.minor} cannot carry {unsendable[str(self.minor)]}, which a "
                f"campaign needs; upgrade to speak {PROTOCOL_VERSION}.{self.minor + 1} or newer"
            )
            logger.error("%s: %s", self.__class__.__name__, detail)
            await self.send_message(ErrorMessage(code="unsupported version", detail=detail))
            await self.close(code=CloseCode.UNSUPPORTED_VERSION, reason=close_reason(detail))
            return
        older = event.get("older")
        await self.send(text_data=older.get(str(self.minor), event["text"]) if older else event["text"])

    def check_version(self, version: int) -> None:
        self.other_major = version != PROTOCOL_VERSION
        if version != PROTOCOL_VERSION or self.minor < OLDEST_MINOR:
            speaks = f"{PROTOCOL_VERSION}.{OLDEST_MINOR} to {PROTOCOL_VERSION}.{settings.CROWDTRAIN_PROTOCOL_MINOR}"
            sent = f"{version}" if version != PROTOCOL_VERSION else f"{version}.{self.minor}"
            raise ProtocolError(
                f"protocol version {sent} is not supported (this site speaks {speaks}); upgrade crowdtrain-agent",
                close_code=CloseCode.UNSUPPORTED_VERSION,
                fatal=True,
            )

    # ------------------------------------------------------------ the hello deadline

    def start_hello_deadline(self) -> None:
        """Close the socket unless it says hello within ``CROWDTRAIN_HELLO_TIMEOUT_S`` of being accepted.

        The timer only posts an event to this consumer's own channel, so the
        check runs between the consumer's other handlers, never inside one.
        """
        event: HelloDeadlineEvent = {"type": "hello.deadline"}
        self._hello_timer = asyncio.get_running_loop().call_later(
            settings.CROWDTRAIN_HELLO_TIMEOUT_S, self.post_to_self, event, lambda: not (self.greeted or self.closed)
        )

    def post_to_self(self, event: Mapping[str, Any], wanted: Callable[[], bool]) -> None:
        """A timer's event, sent back through this consumer's own channel to run between its handlers.

        Every socket of a site process shares one inbox in channels_redis. When
        that inbox is full, or Redis does not answer, the event is sent again
        ``POST_AGAIN_S`` later for as long as ``wanted()`` holds: dropped, a
        waiting lease request would stay unanswered until its agent gave up and
        asked again.
        """
        loop = asyncio.get_running_loop()

        async def post() -> None:
            if not wanted():
                return  # answered, replaced or closed meanwhile
            try:
                await self.channel_layer.send(self.channel_name, dict(event))
            except (ChannelFull, RedisError) as exc:
                if isinstance(exc, RedisError):
                    logger.warning("%s: could not post %s to itself (%s); trying again", self.channel_name, event, exc)
                loop.call_later(POST_AGAIN_S, self.post_to_self, event, wanted)

        task = loop.create_task(post())
        _background.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(_background.discard)

    def _stop_hello_deadline(self) -> None:
        if self._hello_timer is not None:
            self._hello_timer.cancel()
            self._hello_timer = None

    async def hello_deadline(self, _: HelloDeadlineEvent) -> None:
        if self.greeted or self.closed:
            return
        timeout = settings.CROWDTRAIN_HELLO_TIMEOUT_S
        logger.info("%s: no hello within %g s; closing", self.__class__.__name__, timeout)
        detail = f"no hello within {timeout:g} s of connecting; send hello as the first message"
        await self.send_message(ErrorMessage(code="bad message", detail=detail))
        await self.close(code=CloseCode.BAD_MESSAGE)

    # ------------------------------------------------------------ one socket per peer

    async def take_over(self, group: str) -> bool:
        """Become the one socket of ``group`` (a device's or an aggregator's): older ones close with 4012.

        The event goes out before this socket joins the group, and carries its
        channel name besides, so it never closes itself. A stale try (``tries``:
        its client made a newer one since) closes with 4012 itself instead, before
        it has any effect; returns False then, and the caller stops.
        """
        attempt = connection_try(self.scope["headers"])
        if attempt is not None:
            try:
                newest = await offloop(may_take_over)(group, attempt)
            except RedisError:  # Redis away: the newer connection wins, as for clients that name no try
                logger.warning("cannot order connection tries, Redis is unavailable", exc_info=True)
                newest = True
            if not newest:
                logger.info(
                    "%s: try %s of %s came after a newer try of the same client; closing it",
                    self.__class__.__name__, attempt.number, group,
                )  # fmt: skip
                await self.close(code=CloseCode.REPLACED)
                return False
        await replace_connections(group, self.channel_name)
        await memberships.join(self.channel_layer, group, self.channel_name)
        return True

    async def connection_replaced(self, event: ReplacedEvent) -> None:
        if event["channel"] == self.channel_name or self.closed:
            return
        logger.info("%s: a newer connection of the same peer took over; closing this one", self.__class__.__name__)
        await self.close(code=CloseCode.REPLACED)


class WaitOverEvent(TypedDict):
    type: str  # "lease.wait_over": a waiting lease request's time is up; answer it now
    serial: int


class WakeEvent(TypedDict):
    type: str  # "lease.wake": a commit made room for this connection's waiting request
    campaign_id: int
    copy: NotRequired[bool]  # a verification copy waits for it instead (absent: sent by an older site process)


@dataclass
class _WaitingRequest:
    """A lease request held until a commit makes room (or its wait is over)."""

    request: LeaseRequest
    campaign_id: int
    ready_at_step: int  # committed steps after which asking again can succeed
    serial: int  # tells this request's timer from an earlier one's
    timer: asyncio.TimerHandle
    place: str = ""  # its place in the campaign's queue of waiting requests (in Redis)


class AgentConsumer(_ProtocolConsumer):
    """``/ws/agent/``: one volunteer device, authenticated by its API token; one socket per device.

    A lease request that finds every step the device may work on full waits
    here (up to its ``wait_s``) instead of being refused: it queues in Redis,
    and the commit that makes room wakes as many waiting requests as that
    room can serve, whichever site process holds their sockets.
    """

    accepts = AGENT_TO_SITE
    admitted = False
    waiting: _WaitingRequest | None = None
    last_request_id: str | None = None  # None until the connection's first request
    activity: Tracker | None = None  # set once the token is checked
    _serial = 0

    async def connect(self) -> None:
        # Accept first, authenticate after. daphne answers HTTP 403 to a handshake the application has
        # not accepted within its connect timeout (5 s): under load the token lookup waited that long
        # for a database thread, and agents read the 403 as a rejected token and quit. Now a bad token
        # is a close code on an open socket (4001, 4003), and an HTTP error only ever means "busy".
        if not await self.accept_protocol():
            return
        if not admission.admit_socket():
            # Too many sockets or handshakes in hand: turned away before any lookup; agents back off and retry.
            await self.close(code=CloseCode.TRY_AGAIN_LATER)
            return
        self.admitted = True
        self.start_hello_deadline()
        try:
            # Counted as a handshake until the socket is set up, its Redis calls included: a connection
            # holds a Redis connection per call in flight, and an unbounded burst of them took every one.
            await self._set_up()
        finally:
            admission.handshake_done()

    def device_token(self) -> str | None:
        """The device token from ``Authorization: Bearer``, or else from a ``crowdtrain.bearer.<token>`` offer.

        A browser tab cannot set headers on a WebSocket, so it offers its token as a subprotocol
        (2.10); ``accept_protocol`` has checked that offer and never picked it. Only this channel
        reads it: an aggregator sets its header.
        """
        return bearer_token(self.scope["headers"]) or offered_bearer(self.scope.get("subprotocols") or [])

    async def _set_up(self) -> None:
        """Check the token, replace the device's older socket and say the device is here."""
        try:
            device = await offloop(Device.authenticate)(self.device_token())
        except DatabaseError as exc:
            # The database is away (restarting, failing over): "come back later", which agents do with backoff.
            logger.warning("cannot check an agent's token, the database is unavailable (%s); asked it to retry", exc)
            await self.close(code=CloseCode.TRY_AGAIN_LATER)
            return
        if device is None:
            await self.close(code=CloseCode.UNAUTHORIZED)
            return
        if device.is_revoked:
            await self.close(code=CloseCode.REVOKED)
            return
        # One socket per device: a second agent on the same token (or this agent's reconnect while the
        # site still holds its dead socket) replaces the older one, which hears 4012. Before the device is
        # set: a stale try closes here, and its disconnect must not count the device's newer socket gone.
        if not await self.take_over(device_group(device.pk)):
            return
        self.device = device
        standing.note_owner(device.pk, device.owner_id)  # its reports need not read it again
        self.campaigns: set[int] = set()
        self.leases: set[int] = set()  # handed out on this socket and not reported yet
        self.activity = Tracker(device.pk)  # what My devices says this device does now
        await offloop(presence.connected)(device.pk)
        self.activity.connected()
        housekeeping.start()

    async def disconnect(self, code: int) -> None:
        groups = memberships.drop(self.channel_name)  # first, before any await can be cut short
        if self.admitted:
            admission.socket_closed()
        await self._stop_waiting()
        device = getattr(self, "device", None)
        if device is None:
            return
        presence.disconnected(device.pk)
        # Per-process caches of what hellos said: a site that lives for months sees many devices come and go.
        leasing.forget_hardware(device.pk)
        browser_tabs.forget_device(device.pk)
        if self.leases:
            _release_after_grace(device.pk, sorted(self.leases))
        for group in groups:
            await self.channel_layer.group_discard(group, self.channel_name)

    async def on_hello(self, hello: AgentHello) -> None:
        self.check_version(hello.protocol_version)
        if lost := lost_in(hello.device, self.minor, "device."):
            # A tab answered with 2.9 (a site pinned there) says hello as a "browser", which a 2.9 site's
            # decoder refuses: every process of the site refuses it alike, and says why.
            raise ProtocolError(
                f"hello's {', '.join(lost)} is not part of protocol {PROTOCOL_VERSION}.{self.minor}, which this "
                f"connection speaks; this site does not take browser tabs until it speaks "
                f"{PROTOCOL_VERSION}.{DeviceInfo.since_values['kind']['browser']}",
                close_code=CloseCode.UNSUPPORTED_VERSION,
                fatal=True,
            )
        leasing.note_hardware(self.device.pk, hello.device.flops_per_s)
        browser_tabs.note_kind(self.device.pk, hello.device.kind)  # a tab leases only campaigns its graph passed
        hardware = msgspec.structs.asdict(hello.device)
        if network := network_prefix(client_address(self.scope)):  # copies go to someone else (``affinity``)
            hardware["network"] = network
        await offloop(_record_hello)(self.device, hardware)
        self.greeted = True
        await self.send_message(
            Welcome(
                device_id=self.device.pk,
                device_name=self.device.name,
                volunteer=account_name(self.device.owner),
                heartbeat_s=settings.CROWDTRAIN_AGENT_HEARTBEAT_S,
                gone_after_s=settings.CROWDTRAIN_GONE_AFTER_S,
                controls=device_controls(self.device),  # left out for an agent older than 2.8 (advisory)
            )
        )

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if text_data == _HEARTBEAT and self.greeted:
            return  # the commonest frame from idle volunteers: nothing to decode, nothing to do
        await super().receive(text_data, bytes_data)

    async def on_heartbeat(self, _: Heartbeat) -> None:
        """Nothing to do: the open socket is the liveness (``hotstate.Presence`` publishes it in batches)."""

    async def on_paused(self, message: Paused) -> None:
        """The volunteer's controls stopped their agent (or let it go on): My devices says so, nothing else changes."""
        if self.activity is not None:
            self.activity.paused(message.why)

    async def on_lease_request(self, request: LeaseRequest) -> None:
        # request_id (at most 64 characters, the column that stores it) and wait_s (seconds >= 0) are
        # bounded by the message's own field types.
        await self._stop_waiting()  # a new request replaces one still waiting (the agent sent it again)
        if not admission.admit_lease_request():
            busy = NoLease(
                reason="step_full",
                retry_after_s=admission.retry_after(settings.CROWDTRAIN_RETRY_AFTER_S),
                detail=(
                    f"the site is busy ({admission.lease_calls} lease requests in hand); work already done still counts"
                ),
            )
            await self.send_message(busy)
            return
        # An agent sends a request again after a dropped connection or a timeout: only then can the
        # site have answered it already, and only then is the lease lookup worth its query.
        resent = self.last_request_id is None or request.request_id == self.last_request_id
        self.last_request_id = request.request_id
        answer = await self._ask(request, may_be_resent=resent)
        wait_s = min(request.wait_s, settings.CROWDTRAIN_LEASE_WAIT_MAX_S)
        if wait_s > 0:
            held = await self._wait(request, answer, wait_s)
            if held is None:
                return
            answer = held
        await self.send_message(answer.message, campaign_id=answer.campaign_id)

    async def send_message(self, message: Any, *, campaign_id: int | None = None) -> None:
        """Every message to the agent goes out here; its answers are recorded for My devices on the way.

        Args:
            message: the message.
            campaign_id: the campaign a ``NoLease`` speaks for, when known (the page names it).
        """
        if isinstance(message, Lease):
            # Only an older agent can miss something: the newest pays no walk over the lease's fields.
            if self.minor < PROTOCOL_MINOR and (lost := lost_in(message, self.minor)):
                await self._refuse_unreadable_lease(message, ", ".join(lost))
                return
            self.leases.add(message.lease_id)
        elif isinstance(message, NoLease) and message.reason == "quarantined" and self.minor < 2:
            message = msgspec.structs.replace(message, reason="no_campaign")  # a 2.1 agent knows no such reason
        if self.activity is not None:  # after the rewrite: the page says what this agent's terminal says
            self.activity.told(message, campaign_id)
        await super().send_message(message)

    async def _refuse_unreadable_lease(self, lease: Lease, lost: str) -> None:
        """A lease this agent's minor cannot read (an int8 campaign for a 2.2 agent): give it back, say to upgrade.

        The campaign is chosen when the lease is made; an agent that cannot read it
        would ask again and get the same one, so it is told to upgrade, as an
        aggregator is for a slice it cannot serve.
        """
        released = await offloop(endings.release_leases)(self.device.pk, [lease.lease_id])
        for campaign_id, channels in released.woken.items():
            await wake(campaign_id, channels)
        detail = (
            f"protocol {PROTOCOL_VERSION}.{self.minor} cannot carry {lost}, which campaign {lease.campaign_id} "
            f"needs; upgrade crowdtrain-agent to speak {PROTOCOL_VERSION}.{self.minor + 1} or newer"
        )
        logger.info("device %s: %s", self.device.pk, detail)
        await super().send_message(ErrorMessage(code="unsupported version", detail=detail))
        await self.close(code=CloseCode.UNSUPPORTED_VERSION)

    async def _wait(
        self, request: LeaseRequest, answer: leasing.LeaseAnswer, wait_s: float
    ) -> leasing.LeaseAnswer | None:
        """Hold a refused request in the campaign's queue until a commit wakes it (None), or return what to send.

        Room that appeared between the refusal and the queueing is asked for again at
        once, a few times at most; the answer that gets is the one to send.
        """
        for _ in range(3):
            refusal = answer.message
            if not isinstance(refusal, NoLease) or refusal.ready_at_step is None or answer.campaign_id is None:
                return answer
            place = await offloop(parking.park)(
                answer.campaign_id, self.device.pk, request.samples_per_s, self.channel_name, refusal.ready_at_step
            )
            if place is not None:
                self._serial += 1
                event: WaitOverEvent = {"type": "lease.wait_over", "serial": self._serial}
                timer = asyncio.get_running_loop().call_later(
                    wait_s, self.post_to_self, event, functools.partial(self._still_waiting, self._serial)
                )
                self.waiting = _WaitingRequest(
                    request, answer.campaign_id, refusal.ready_at_step, self._serial, timer, place
                )
                if self.activity is not None:
                    self.activity.queued(answer.campaign_id, refusal.ready_at_step)
                return None
            answer = await self._ask(request)
        return answer

    async def lease_wake(self, event: WakeEvent) -> None:
        waiting = self.waiting
        if waiting is None or waiting.campaign_id != event["campaign_id"]:
            # Answered meanwhile (its own report's commit, say): the room goes to the next in line.
            await wake(event["campaign_id"], await offloop(parking.pass_on_wake)(event["campaign_id"]))
            return
        waiting.place = ""  # the commit took it out of the queue
        if event.get("copy"):
            checks.copies_may_wait(waiting.campaign_id)  # queued maybe by another process: look now
        await self._answer_waiting(final=False)

    def _still_waiting(self, serial: int) -> bool:
        return self.waiting is not None and self.waiting.serial == serial

    async def lease_wait_over(self, event: WaitOverEvent) -> None:
        if self._still_waiting(event["serial"]):
            await self._answer_waiting(final=True)

    async def _answer_waiting(self, *, final: bool) -> None:
        """Ask again for the waiting request: answer it with a lease, or, when its time is up, with the refusal."""
        waiting = self.waiting
        if waiting is not None:
            await self._settle(waiting, await self._ask(waiting.request), final=final)

    async def _settle(self, waiting: _WaitingRequest, answer: leasing.LeaseAnswer, *, final: bool = False) -> None:
        if self.waiting is not waiting:
            return  # replaced meanwhile; the newer request gets its own answer
        message = answer.message
        if isinstance(message, NoLease) and message.ready_at_step is not None and not final:
            # Another device took the room: queue again for the next commit.
            leave, waiting.place = waiting.place, ""
            place = await offloop(parking.park)(
                waiting.campaign_id,
                self.device.pk,
                waiting.request.samples_per_s,
                self.channel_name,
                message.ready_at_step,
                leave,
            )
            if place is not None:
                waiting.place, waiting.ready_at_step = place, message.ready_at_step
                if self.activity is not None:
                    self.activity.queued(waiting.campaign_id, message.ready_at_step)
                return
            await self._settle(waiting, await self._ask(waiting.request), final=True)
            return
        await self._stop_waiting()
        await self.send_message(message, campaign_id=answer.campaign_id)

    async def _stop_waiting(self) -> None:
        waiting, self.waiting = self.waiting, None
        if waiting is not None:
            waiting.timer.cancel()
            if waiting.place:
                await offloop(parking.unpark)(waiting.campaign_id, waiting.place)

    async def _ask(self, request: LeaseRequest, *, may_be_resent: bool = False) -> leasing.LeaseAnswer:
        admission.lease_calls += 1
        started = time.perf_counter()
        try:
            answer = await offloop(leasing.ask_lease)(
                self.device.pk,
                request.campaign_id,
                request.samples_per_s,
                request.request_id,
                may_be_resent=may_be_resent,
                backups=admission.load < BACKUPS_BELOW_LOAD,
            )
        finally:
            admission.lease_calls -= 1
            LEASE_REQUEST_SECONDS.observe(time.perf_counter() - started)
        if isinstance(answer.message, NoLease) and admission.load > 0:
            # A busy site spreads the next requests out: the refusal's wait grows with the load.
            stretched = admission.retry_after(answer.message.retry_after_s)
            answer = leasing.LeaseAnswer(
                msgspec.structs.replace(answer.message, retry_after_s=stretched), answer.campaign_id
            )
        await self._watch(answer)
        return answer

    async def _watch(self, answer: leasing.LeaseAnswer) -> None:
        """Hear a campaign's version pushes only while told to wait for it (paused, no aggregators).

        A connection that works, or waits in the campaign's queue, needs none: 10,000 agents
        must not each receive every published version.
        """
        message, campaign_id = answer.message, answer.campaign_id
        idle = isinstance(message, NoLease) and message.reason == "campaign_paused" and campaign_id is not None
        if idle and campaign_id not in self.campaigns and len(self.campaigns) < MAX_WATCHED_CAMPAIGNS:
            assert campaign_id is not None  # idle says so
            self.campaigns.add(campaign_id)
            await memberships.join(self.channel_layer, campaign_agents_group(campaign_id), self.channel_name)
        elif not idle and self.campaigns:
            for watched in self.campaigns:
                await memberships.leave(self.channel_layer, campaign_agents_group(watched), self.channel_name)
            self.campaigns.clear()

    async def on_done(self, done: LeaseDone) -> None:
        waiting = self.waiting
        outcome, answer = await offloop(_report)(self.device.pk, done, waiting.request if waiting else None)
        self.leases.discard(done.lease_id)
        # The critical path of a step first: the aggregators' commit (if the thread could not publish it),
        # then the agent's ack and next lease.
        await send_commits(outcome.commits)
        await self.send_message(outcome.ack)
        if waiting is not None and answer is not None:
            await self._watch(answer)
            await self._settle(waiting, answer)

    async def on_release(self, release: LeaseRelease) -> None:
        self.leases.discard(release.lease_id)
        released = await offloop(endings.release_leases)(self.device.pk, [release.lease_id])
        await self.send_message(ReleaseAck(lease_id=release.lease_id))
        for campaign_id, channels in released.woken.items():
            await wake(campaign_id, channels)

    async def device_controls(self, event: ControlsEvent) -> None:
        """Controls changed on My devices reach the connected agent; an agent older than 2.9 takes them when it
        next connects (its welcome carries them)."""
        if self.minor < CONTROLS_PUSHED_SINCE:
            return
        await self.send_message(ControlsChanged(controls=stored_controls(event["controls"])))

    async def device_revoked(self, event: RevokedEvent) -> None:
        logger.info("device %s revoked: %s", self.device.pk, event["reason"])
        await self.close(code=CloseCode.REVOKED)


def _report(
    device_id: int, done: LeaseDone, waiting: LeaseRequest | None
) -> tuple[reporting.DoneOutcome, leasing.LeaseAnswer | None]:
    """``reporting.report_and_request``; the aggregators hear its commits from this thread, not after the turn."""
    outcome, answer = reporting.report_and_request(device_id, done, waiting)
    publish_commits(outcome.commits)
    return outcome, answer


def _release_after_grace(device_id: int, lease_ids: list[int]) -> None:
    """In CROWDTRAIN_DISCONNECT_GRACE_S, release the leases of an agent whose socket closed, unless it is back."""
    since = hot_state().clock()

    async def release() -> None:
        try:
            released = await offloop(endings.release_if_gone)(device_id, lease_ids, since)
        except Exception:  # the deadline sweep frees them anyway
            logger.warning("could not release the leases of disconnected device %s", device_id, exc_info=True)
            return
        if released.count:
            logger.info("device %s did not come back: %s of its leases released", device_id, released.count)
        for campaign_id, channels in released.woken.items():
            await wake(campaign_id, channels)

    def start() -> None:
        task = loop.create_task(release())
        _background.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(_background.discard)

    loop = asyncio.get_running_loop()
    loop.call_later(settings.CROWDTRAIN_DISCONNECT_GRACE_S, start)


_background: set[asyncio.Task[None]] = set()


def _record_hello(device: Device, hardware: dict[str, Any]) -> None:
    """Keep what the agent says about its hardware, written only when it says something new.

    Merged, not replaced: the host and OS the agent reported at login stay on
    the devices page. An agent that reconnects with the same hardware costs no
    write (``last_seen_at`` is stamped in batches by ``housekeeping``), unless
    the device has not been stamped for a while, so its page says "online" at once.
    """
    saved = device.hardware if isinstance(device.hardware, dict) else {}
    merged = {**saved, **hardware}
    now = timezone.now()
    stale = device.last_seen_at is None or (now - device.last_seen_at).total_seconds() > LAST_SEEN_DB_EVERY_S
    if merged != saved or stale:
        Device.objects.filter(pk=device.pk).update(hardware=merged, last_seen_at=now)
        device.hardware, device.last_seen_at = merged, now


class BackboneConsumer(_ProtocolConsumer):
    """``/ws/backbone/``: one aggregator, authenticated by its backbone token.

    One socket per aggregator: a newer one replaces the older (4012) when it
    says hello, and from then on only the newer one's close pauses the
    aggregator's slices (``backbone.aggregator_left``).
    """

    accepts = BACKBONE_TO_SITE
    last_touched = 0.0
    _upkeep: asyncio.Task[None] | None = None  # the last heartbeat's upkeep

    async def connect(self) -> None:
        if not await self.accept_protocol():  # before the token lookup, as AgentConsumer.connect explains
            return
        self.start_hello_deadline()
        try:
            aggregator = await database_sync_to_async(Aggregator.authenticate)(bearer_token(self.scope["headers"]))
        except DatabaseError as exc:  # as for agents: "come back later", and the aggregator does with backoff
            logger.warning(
                "cannot check an aggregator's token, the database is unavailable (%s); asked it to retry", exc
            )
            await self.close(code=CloseCode.TRY_AGAIN_LATER)
            return
        if aggregator is None:
            await self.close(code=CloseCode.UNAUTHORIZED)
            return
        self.aggregator = aggregator

    async def disconnect(self, code: int) -> None:
        groups = memberships.drop(self.channel_name)  # first, before any await can be cut short
        aggregator = getattr(self, "aggregator", None)
        if aggregator is None or not self.greeted:
            return
        await subscriber.release(aggregator.pk, self.socket_send)
        for group in groups:
            await self.channel_layer.group_discard(group, self.channel_name)
        # Only the aggregator's current socket speaks for it: the close of one a newer socket replaced
        # (or that daphne noticed dead only after the aggregator reconnected) changes nothing.
        if await database_sync_to_async(backbone.aggregator_left)(aggregator.pk, channel_name=self.channel_name):
            logger.warning("aggregator %s disconnected; its campaigns pause until it returns", aggregator.name)
        else:
            logger.info("aggregator %s: an older connection closed; the newer one carries on", aggregator.name)

    async def on_backbone_hello(self, hello: BackboneHello) -> None:
        self.check_version(hello.protocol_version)
        if self.minor < backbone.oldest_aggregator_minor():
            # Refused before it joins: joined, it would be given slices it cannot serve and the campaign would wait.
            raise ProtocolError(
                f"an aggregator of protocol {PROTOCOL_VERSION}.{self.minor} cannot serve this site's campaigns: each "
                "signs its tickets with its own key, which reaches aggregators as assign.ticket_key "
                f"({PROTOCOL_VERSION}.1); upgrade crowdtrain on the aggregator, or run the site with "
                "CROWDTRAIN_PROTOCOL_MINOR=0 until every aggregator is upgraded",
                close_code=CloseCode.UNSUPPORTED_VERSION,
                fatal=True,
            )
        self.greeted = True
        if not await self.take_over(backbone_group(self.aggregator.pk)):
            return  # a stale try: its close changes nothing, the newer socket is the aggregator's current one
        await subscriber.hold(self.aggregator.pk, self.socket_send)  # its orders, ahead of this consumer's queue
        await self.send_message(
            BackboneWelcome(
                aggregator_id=self.aggregator.pk,
                ticket_key=backbone.welcome_ticket_key(),
                heartbeat_s=settings.CROWDTRAIN_HEARTBEAT_S,
            )
        )
        joined = await database_sync_to_async(backbone.aggregator_joined)(
            self.aggregator.pk, hello, channel_name=self.channel_name
        )
        await send_outbox(joined)
        await offloop(heartbeats.aggregator_heard)(self.aggregator.pk)
        logger.info(
            "aggregator %s joined from %s", self.aggregator.name, hello.upload_url,
            extra={"aggregator": self.aggregator.name},
        )  # fmt: skip

    async def on_heartbeat(self, _: Heartbeat) -> None:
        """The heartbeat's upkeep runs beside this consumer's messages, not before the next one.

        It waits for the site's busy thread pools, up to about a second under load (docs/performance.md,
        "Aggregator orders"), and a step's ``applied`` that came in meanwhile, which agents wait on,
        waited behind it. One
        heartbeat's upkeep at a time: a heartbeat that finds the last one's still running skips its own.
        """
        if self._upkeep is not None and not self._upkeep.done():
            return
        self._upkeep = asyncio.get_running_loop().create_task(self._heartbeat_upkeep())

    async def _heartbeat_upkeep(self) -> None:
        if self.closed:
            return
        try:
            # Recorded and joined again each time: a Redis that restarted empty forgot which process holds
            # this socket (the lane of backbone_lane) and its group (the channel layer's way, the lane's
            # fallback), and the orders (those below included) would be lost until the aggregator reconnected,
            # which it has no reason to do. Every heartbeat, not once a minute as agents' groups: a step waits.
            await subscriber.hold(self.aggregator.pk, self.socket_send)
            await self.channel_layer.group_add(backbone_group(self.aggregator.pk), self.channel_name)
            # For the silent-aggregator alert (crowdtrain.ops.health): one Redis write, seconds-accurate.
            await offloop(heartbeats.aggregator_heard)(self.aggregator.pk)
            now = time.monotonic()
            if now - self.last_touched > LAST_SEEN_EVERY_S:  # the database's "last seen" is for people, lazily
                self.last_touched = now
                await database_sync_to_async(backbone.touch_aggregator)(self.aggregator.pk)
            # Campaigns started after the aggregators joined get their slices here, and commits
            # the channel layer lost are sent again.
            await send_outbox(await database_sync_to_async(backbone.assign_waiting_campaigns)())
            await send_outbox(await database_sync_to_async(backbone.stalled_commits)(self.aggregator.pk))
        except Exception:  # the next heartbeat tries again
            logger.exception("aggregator %s: heartbeat upkeep failed", self.aggregator.name)

    async def on_slice_ready(self, ready: SliceReady) -> None:
        await send_outbox(await database_sync_to_async(backbone.slice_ready)(self.aggregator.pk, ready))

    async def on_slice_lost(self, lost: SliceLost) -> None:
        await database_sync_to_async(backbone.slice_lost)(self.aggregator.pk, lost)

    async def on_upload_refused(self, refused: UploadRefused) -> None:
        await database_sync_to_async(refusals.note)(self.aggregator.pk, refused)

    async def on_checkpoint_saved(self, saved: CheckpointSaved) -> None:
        await send_outbox(await database_sync_to_async(backbone.checkpoint_saved)(self.aggregator.pk, saved))

    async def on_applied(self, applied: StepApplied) -> None:
        published = await database_sync_to_async(backbone.step_applied)(self.aggregator.pk, applied)
        if published is not None:
            await send_to_group(campaign_agents_group(published.campaign_id), published)

    async def on_step_failed(self, failed: StepFailed) -> None:
        logger.warning(
            "aggregator %s could not apply step %s of campaign %s: %s (missing leases %s)",
            self.aggregator.name,
            failed.step,
            failed.campaign_id,
            failed.detail,
            failed.missing_lease_ids,
        )
        await send_outbox(await database_sync_to_async(backbone.step_failed)(self.aggregator.pk, failed))
