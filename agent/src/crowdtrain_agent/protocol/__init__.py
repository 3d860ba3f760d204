"""The Crowdtrain wire protocol: messages, binary frames, tickets. Standard library only."""

from __future__ import annotations

from .errors import ProtocolError
from .frames import (
    CHUNK_PAYLOAD_BYTES,
    GONE_AFTER_S,
    HEARTBEAT_INTERVAL_S,
    MAX_CONTROL_MESSAGE_BYTES,
    MAX_WS_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    CloseCode,
    chunk_fragments,
    decode_chunk,
    encode_chunk,
    should_reconnect,
    split_payload,
)
from .messages import *  # noqa: F403  (messages.__all__ lists the message classes)
from .messages import MESSAGE_TYPES, decode_message, encode_message
from .tickets import Ticket, sign_receipt, sign_ticket, verify_receipt, verify_ticket

__all__ = [
    "CHUNK_PAYLOAD_BYTES", "GONE_AFTER_S", "HEARTBEAT_INTERVAL_S", "MAX_CONTROL_MESSAGE_BYTES",
    "MAX_WS_MESSAGE_BYTES", "MESSAGE_TYPES", "PROTOCOL_VERSION", "CloseCode", "ProtocolError", "Ticket",
    "chunk_fragments", "decode_chunk", "decode_message", "encode_chunk", "encode_message", "should_reconnect",
    "sign_receipt", "sign_ticket", "split_payload", "verify_receipt", "verify_ticket",
]  # fmt: skip
