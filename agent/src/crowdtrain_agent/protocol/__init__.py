"""The Crowdtrain wire protocol: messages, binary frames, tickets. The standard library and msgspec only."""

from __future__ import annotations

from .errors import ProtocolError
from .frames import (
    CHUNK_PAYLOAD_BYTES,
    GONE_AFTER_S,
    HEARTBEAT_INTERVAL_S,
    MAX_CONTROL_MESSAGE_BYTES,
    MAX_WS_MESSAGE_BYTES,
    OLDEST_MINOR,
    PROTOCOL_MINOR,
    PROTOCOL_VERSION,
    CloseCode,
    choose_subprotocol,
    chunk_fragments,
    decode_chunk,
    encode_chunk,
    negotiated_minor,
    offered_subprotocols,
    should_reconnect,
    split_payload,
)
from .messages import *  # noqa: F403  (messages.__all__ lists the message classes)
from .messages import MESSAGE_TYPES, decode_message, encode_message
from .tickets import (
    Ticket,
    campaign_key,
    receipt_sketch,
    sign_receipt,
    sign_ticket,
    ticket_campaign,
    ticket_is_check,
    verify_receipt,
    verify_ticket,
)

__all__ = [
    "CHUNK_PAYLOAD_BYTES",
    "GONE_AFTER_S",
    "HEARTBEAT_INTERVAL_S",
    "MAX_CONTROL_MESSAGE_BYTES",
    "MAX_WS_MESSAGE_BYTES",
    "MESSAGE_TYPES",
    "OLDEST_MINOR",
    "PROTOCOL_MINOR",
    "PROTOCOL_VERSION",
    "CloseCode",
    "ProtocolError",
    "Ticket",
    "campaign_key",
    "choose_subprotocol",
    "chunk_fragments",
    "decode_chunk",
    "decode_message",
    "encode_chunk",
    "encode_message",
    "negotiated_minor",
    "offered_subprotocols",
    "should_reconnect",
    "receipt_sketch",
    "sign_receipt",
    "sign_ticket",
    "split_payload",
    "ticket_campaign",
    "ticket_is_check",
    "verify_receipt",
    "verify_ticket",
]
