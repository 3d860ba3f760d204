"""Channel-layer addresses and how messages reach agents and aggregators through them.

Groups: ``backbone.<aggregator id>`` (one aggregator's socket),
``campaign.<id>.agents`` (every agent working on a campaign),
``device.<id>`` (one agent's socket, for revocation and its controls). A device or an
aggregator has one socket at a time: a newer one sends ``connection.replaced``
to the group before it joins, and the older one closes with 4012. Waiting lease
requests are woken one by one on their own channels (``send_commits``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, TypedDict

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

from crowdtrain.scheduler.backbone import assign_waiting_campaigns
from crowdtrain.scheduler.commits import Commit
from crowdtrain_agent.protocol import OLDEST_MINOR, PROTOCOL_MINOR, VersionPublished, encode_message
from crowdtrain_agent.protocol.schema import lost_in

from . import backbone_lane
from .channel_layer import send_each

logger = logging.getLogger(__name__)


class SendEvent(TypedDict, total=False):
    type: str  # "socket.send": the consumer writes ``text`` to its socket as is
    text: str  # the message as this site's own protocol minor encodes it
    # The same message for peers of older minors, when it differs (fields their minor lacks left out);
    # keyed by the minor as a string (channel layers carry msgpack maps).
    older: dict[str, str]
    # Minors that cannot carry the message at all (fields set that they lack), with those fields.
    unsendable: dict[str, str]


def send_event(message: Any) -> SendEvent:
    """A socket.send event for ``message``, readable by every protocol minor a consumer may speak."""
    text = encode_message(message)
    event: SendEvent = {"type": "socket.send", "text": text}
    older: dict[str, str] = {}
    unsendable: dict[str, str] = {}
    for minor in range(OLDEST_MINOR, PROTOCOL_MINOR):
        lost = lost_in(message, minor)
        if lost:
            unsendable[str(minor)] = ", ".join(lost)
        elif (older_text := encode_message(message, minor)) != text:
            older[str(minor)] = older_text
    if older:
        event["older"] = older
    if unsendable:
        event["unsendable"] = unsendable
    return event


class RevokedEvent(TypedDict):
    type: str  # "device.revoked"
    reason: str


class ControlsEvent(TypedDict):
    type: str  # "device.controls": the volunteer changed the device's controls on My devices
    controls: dict[str, Any]  # as stored on the device ({}: none set)


class ReplacedEvent(TypedDict):
    type: str  # "connection.replaced": a newer socket of the same device or aggregator took over
    channel: str  # the newer socket's channel name: it must not close itself


def backbone_group(aggregator_id: int) -> str:
    return f"backbone.{aggregator_id}"


def campaign_agents_group(campaign_id: int) -> str:
    return f"campaign.{campaign_id}.agents"


def device_group(device_id: int) -> str:
    return f"device.{device_id}"


async def send_to_group(group: str, message: Any) -> None:
    await get_channel_layer().group_send(group, send_event(message))


async def send_outbox(outbox: Iterable[tuple[int, Any]]) -> None:
    """Deliver (aggregator id, message) pairs returned by the scheduler (``backbone_lane`` says how)."""
    for aggregator_id, message in outbox:
        await backbone_lane.send(aggregator_id, send_event(message), backbone_group(aggregator_id))


def publish_commits(commits: Iterable[Commit]) -> None:
    """Tell the aggregators of steps just committed, from the committing thread, before its loop hears of them.

    A commit whose aggregators all heard is marked ``delivered``; ``send_commits``
    sends the others again from the loop.
    """
    for commit in commits:
        commit.delivered = backbone_lane.publish_now(
            (aggregator_id, send_event(commit.message)) for aggregator_id in commit.aggregator_ids
        )


async def send_commits(commits: Iterable[Commit]) -> None:
    """Tell the aggregators to apply the steps just committed, then wake the lease requests the room serves.

    Only the requests the commit chose (``Commit.woken``) hear of it, each on
    its own channel: a commit costs the same with ten or ten thousand agents waiting.
    """
    for commit in commits:
        if not commit.delivered:
            await send_outbox((aggregator_id, commit.message) for aggregator_id in commit.aggregator_ids)
    for commit in commits:
        await wake(commit.message.campaign_id, commit.woken)


async def wake(campaign_id: int, channels: Iterable[str], *, copy: bool = False) -> None:
    """Tell these sockets' waiting lease requests that a commit of the campaign made room for them.

    With ``copy``, what waits for them is a verification copy (``checks.wake_for_copy``), not room.
    A socket whose site process has a full inbox is passed over rather than
    holding up the rest: its request is answered when its wait is over, and
    the room it was woken for goes to the next request that asks.
    """
    layer = get_channel_layer()
    event = {"type": "lease.wake", "campaign_id": campaign_id, "copy": copy}
    send_many = getattr(layer, "send_many", None)  # the site's Redis layer: a few round trips for them all
    unheard = await (send_many(channels, event) if send_many is not None else send_each(layer, channels, event))
    if unheard:
        logger.warning(
            "campaign %s: %d waiting lease requests not woken, their site process's channel-layer inbox is full; "
            "they are answered when their wait is over (raise CROWDTRAIN_CHANNEL_LAYER_CAPACITY if this recurs)",
            campaign_id,
            unheard,
        )


async def revoke_device(device_id: int, reason: str) -> None:
    """Disconnect a device's agent at once; it is told why by the close code."""
    event: RevokedEvent = {"type": "device.revoked", "reason": reason}
    await get_channel_layer().group_send(device_group(device_id), event)


async def push_controls(device_id: int, controls: dict[str, Any]) -> None:
    """Hand a device's new controls to its connected agent, if any (an agent of 2.9 or newer takes them at once)."""
    event: ControlsEvent = {"type": "device.controls", "controls": controls}
    await get_channel_layer().group_send(device_group(device_id), event)


async def replace_connections(group: str, channel_name: str) -> None:
    """Tell the sockets in ``group`` that the socket ``channel_name`` takes over; they close with 4012.

    Sent before the new socket joins ``group``. Through the channel layer, so
    an older socket held by another site process hears it too.
    """
    event: ReplacedEvent = {"type": "connection.replaced", "channel": channel_name}
    await get_channel_layer().group_send(group, event)


def campaign_running(*, campaign_id: int, version: int, **_: Any) -> None:
    """A campaign started or resumed (``campaigns.signals``): live aggregators get its slices now rather than at
    their next heartbeat, and agents told "paused, ask again in 10 s" wake on a version push."""
    outbox = assign_waiting_campaigns()
    if outbox:
        async_to_sync(send_outbox)(outbox)
    wake = VersionPublished(campaign_id=campaign_id, version=version)
    async_to_sync(send_to_group)(campaign_agents_group(campaign_id), wake)


def device_revoked(*, device_id: int, reason: str, **_: Any) -> None:
    """A device was revoked (``devices.signals``): its agent's sockets close now, wherever they are."""
    async_to_sync(revoke_device)(device_id, reason)


def device_controls_changed(*, device_id: int, controls: dict[str, Any], **_: Any) -> None:
    """A device's controls changed on My devices (``devices.signals``): its connected agent takes them now."""
    async_to_sync(push_controls)(device_id, controls)
