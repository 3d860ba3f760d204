"""Binary frame layout, size limits and WebSocket close codes of the Crowdtrain protocol."""

from __future__ import annotations

import enum
import itertools
import secrets
import struct
from dataclasses import dataclass

# The major version: peers of different majors cannot talk (close code 4004, "upgrade").
PROTOCOL_VERSION = 2
# The minor version, negotiated per connection as the WebSocket subprotocol "crowdtrain.<major>.<minor>";
# a peer that offers none (every 2.0 agent and site) speaks minor 0. Each side speaks its own minor
# and the one before, decodes fields it does not know by ignoring them, and leaves out of what it
# sends the fields its peer's minor lacks. History (agent/PROTOCOL.md has the rule):
#   2.0  lease_request.wait_s, no_lease.ready_at_step, lease.prefetch; decoders refuse unknown fields
#   2.1  decoders ignore unknown fields; every number bounded; hello.protocol_version required
#   2.2  verification (ticket.check, sketches in receipts, done_ack.verification, no_lease "quarantined")
#        and robust aggregation (assign.aggregation, clip_factor, trim_fraction)
#   2.3  the int8 codec (codec "int8"; lease, assign and upload codec_block_size); local-steps leases
#   2.4  lease.rebase_to: a local-steps lease that overlaps the publication of its round's base
#   2.5  assign, commit and rollback timeline: an aggregator drops a commit written before a rollback
#   2.6  token datasets: lease.data kind "tokens" with token_bytes, vocab_size and tokenizer; data.augment;
#        assign.initial: pretrained weights as version 0
#   2.7  upload_refused: an aggregator tells the site of an upload refused for its content
#   2.8  paused: an agent tells the site its volunteer's controls stopped work, and why
#   2.9  controls: the site pushes controls changed on My devices to a connected agent
#   2.10 a browser tab is a device: device.kind "browser", device.runtime; a client that cannot set headers
#        offers its token as the subprotocol "crowdtrain.bearer.<token>"
PROTOCOL_MINOR = 10
# A site serves every minor of its major: volunteers upgrade at their own pace until the next major. An older
# peer that cannot carry what a campaign needs is refused at that message, with the field to upgrade for.
OLDEST_MINOR = 0

# Every WebSocket message either side sends stays under 1 MiB: daphne and the
# `websockets` client both drop larger ones by default (../shared/STACK.md).
MAX_WS_MESSAGE_BYTES = 1 << 20
# JSON control messages are small; anything bigger is an attack or a bug.
MAX_CONTROL_MESSAGE_BYTES = 64 << 10
# What an agent puts in one binary chunk; leaves room for the chunk header.
CHUNK_PAYLOAD_BYTES = 512 << 10
MAX_CHUNK_PAYLOAD_BYTES = MAX_WS_MESSAGE_BYTES - 64

# Liveness: both agents and aggregators send a heartbeat this often, and the
# site treats a peer silent for GONE_AFTER_S as gone and frees what it held.
HEARTBEAT_INTERVAL_S = 2.0
GONE_AFTER_S = 10.0

_CHUNK_MAGIC = b"CTGC"
_CHUNK_HEADER = struct.Struct("!4sIII")
CHUNK_HEADER_BYTES = _CHUNK_HEADER.size


MAX_CLOSE_REASON_BYTES = 123  # RFC 6455: a close frame's payload is at most 125 bytes, 2 of them the code


def close_reason(text: str) -> str:
    """``text`` cut to what a close frame carries (123 bytes of UTF-8), at a character boundary."""
    data = text.encode("utf-8")
    if len(data) <= MAX_CLOSE_REASON_BYTES:
        return text
    return data[: MAX_CLOSE_REASON_BYTES - 3].decode("utf-8", "ignore") + "..."


class CloseCode(enum.IntEnum):
    """WebSocket close codes (4000-4999) and whether a client should reconnect."""

    BAD_MESSAGE = 4000  # malformed or unknown message; reconnecting is fine
    UNAUTHORIZED = 4001  # missing, wrong or expired token: log in again
    REVOKED = 4003  # the volunteer revoked this device in the browser
    UNSUPPORTED_VERSION = 4004  # protocol version mismatch: upgrade the agent
    TOO_LARGE = 4008  # a message over the size limit
    TOO_MANY_ERRORS = 4009  # the peer kept sending bad messages
    BAD_TICKET = 4010  # a gradient upload with a ticket that does not verify
    GOING_AWAY = 4011  # server shutting down; reconnect with backoff
    REPLACED = 4012  # the same device connected again elsewhere
    # The site is saturated or cannot check tokens right now (its database is away): back off and come back.
    # RFC 6455's 1013 says the same, but daphne (autobahn) sends only 1000 and 3000-4999: 1013 crashed the
    # consumer, and the client saw 1011.
    TRY_AGAIN_LATER = 4013


_FINAL_CODES = {CloseCode.UNAUTHORIZED, CloseCode.REVOKED, CloseCode.UNSUPPORTED_VERSION, CloseCode.REPLACED}


def should_reconnect(code: int | None) -> bool:
    """Whether a client closed with ``code`` should try again after a backoff.

    Args:
        code: the WebSocket close code received, or None if the TCP connection dropped.

    Returns:
        False for codes that no retry can fix (bad credentials, revoked device,
        protocol mismatch, replaced by a newer connection); True otherwise.
    """
    return code is None or code not in _FINAL_CODES


# Names a client's connection try on the WebSocket handshake: "<instance>/<try>", where the instance is
# random per client process and the try counts up within it. Under load a site process can act on a try
# the client already gave up on after a newer try was welcomed elsewhere; the site then keeps the newer
# one (4012 goes to the stale try) instead of stopping a working agent for good.
CONNECTION_HEADER = "X-Crowdtrain-Connection"
_INSTANCE_CHARS = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class ConnectionTry:
    """One connection try of one client process (``CONNECTION_HEADER``)."""

    instance: str  # 8 to 32 lowercase hex digits, random per process
    number: int  # counts up from 1 within the process

    def header(self) -> str:
        return f"{self.instance}/{self.number}"


class ConnectionTries:
    """Numbers one client's connection tries (an agent's control channel, an aggregator's site link)."""

    def __init__(self) -> None:
        self.instance = secrets.token_hex(8)
        self._numbers = itertools.count(1)

    def next(self) -> ConnectionTry:
        return ConnectionTry(self.instance, next(self._numbers))


def parse_connection_try(value: str | None) -> ConnectionTry | None:
    """The try a handshake header names; None when absent or malformed (the socket is then unordered)."""
    instance, slash, number = (value or "").strip().partition("/")
    if (
        not slash
        or not 8 <= len(instance) <= 32
        or not set(instance) <= _INSTANCE_CHARS
        or not number.isascii()
        or not number.isdigit()
        or len(number) > 15  # exact in the site's Lua, whose numbers are doubles
    ):
        return None
    return ConnectionTry(instance, int(number))


@dataclass(frozen=True)
class ChunkHeader:
    """The fixed header at the front of every binary gradient chunk.

    Layout (network byte order): ``b"CTGC"``, chunk index (u32), number of
    chunks of this upload (u32), payload length in bytes (u32); the payload
    follows immediately.
    """

    chunk_index: int
    num_chunks: int
    payload_len: int


def encode_chunk(chunk_index: int, num_chunks: int, payload: bytes | memoryview) -> bytes:
    """Prefix ``payload`` with its chunk header.

    Raises:
        ValueError: if the payload is larger than MAX_CHUNK_PAYLOAD_BYTES.
    """
    if len(payload) > MAX_CHUNK_PAYLOAD_BYTES:
        raise ValueError(f"chunk payload of {len(payload)} bytes is over the {MAX_CHUNK_PAYLOAD_BYTES} byte limit")
    return chunk_header(chunk_index, num_chunks, len(payload)) + payload


def chunk_header(chunk_index: int, num_chunks: int, payload_len: int) -> bytes:
    """The header alone, for senders that send it and the payload as two fragments of one message."""
    return _CHUNK_HEADER.pack(_CHUNK_MAGIC, chunk_index, num_chunks, payload_len)


def decode_chunk(frame: bytes) -> tuple[ChunkHeader, memoryview]:
    """Split a binary frame into its header and payload, checking the layout.

    Raises:
        ProtocolError: if the magic, lengths or size limit are wrong.
    """
    from .errors import ProtocolError

    if len(frame) > MAX_WS_MESSAGE_BYTES:
        raise ProtocolError(
            f"binary frame of {len(frame)} bytes is over the {MAX_WS_MESSAGE_BYTES} byte limit; "
            f"send chunks of at most {CHUNK_PAYLOAD_BYTES} bytes",
            close_code=CloseCode.TOO_LARGE,
        )
    if len(frame) < CHUNK_HEADER_BYTES:
        raise ProtocolError(
            f"binary frame of {len(frame)} bytes is shorter than the {CHUNK_HEADER_BYTES} byte chunk header"
        )
    magic, index, total, length = _CHUNK_HEADER.unpack_from(frame)
    if magic != _CHUNK_MAGIC:
        raise ProtocolError(f"binary frame starts with {magic!r}, expected {_CHUNK_MAGIC!r}")
    if length != len(frame) - CHUNK_HEADER_BYTES:
        raise ProtocolError(
            f"chunk header says {length} payload bytes but the frame carries {len(frame) - CHUNK_HEADER_BYTES}"
        )
    if total == 0 or index >= total:
        raise ProtocolError(f"chunk index {index} is outside 0..{total - 1}")
    return ChunkHeader(index, total, length), memoryview(frame)[CHUNK_HEADER_BYTES:]


def split_payload(payload: bytes | memoryview, chunk_bytes: int = CHUNK_PAYLOAD_BYTES) -> list[bytes]:
    """Cut an encoded slice into framed chunks ready to send, in order."""
    return [header + bytes(part) for header, part in chunk_fragments(payload, chunk_bytes)]


def chunk_fragments(
    payload: bytes | memoryview, chunk_bytes: int = CHUNK_PAYLOAD_BYTES
) -> list[tuple[bytes, memoryview]]:
    """The chunks of ``split_payload`` as (header, payload view) pairs, copying nothing.

    Sent as two fragments of one WebSocket message (RFC 6455 section 5.4), a
    pair arrives as the same single binary message ``split_payload`` makes;
    the agent sends a gradient this way so its bytes are never copied
    before the socket masks them.
    """
    view = memoryview(payload).cast("B")
    count = max(1, -(-len(view) // chunk_bytes))
    pairs = []
    for i in range(count):
        part = view[i * chunk_bytes : (i + 1) * chunk_bytes]
        if len(part) > MAX_CHUNK_PAYLOAD_BYTES:
            raise ValueError(f"chunk payload of {len(part)} bytes is over the {MAX_CHUNK_PAYLOAD_BYTES} byte limit")
        pairs.append((chunk_header(i, count, len(part)), part))
    return pairs
