from __future__ import annotations

import json

import pytest
from hypothesis import given, strategies as st

from crowdtrain_agent.protocol import MESSAGE_TYPES, LeaseDone, ProtocolError, decode_message, encode_message

from .strategies import strategy_for


@pytest.mark.parametrize("kind", sorted(MESSAGE_TYPES))
@given(data=st.data())
def test_every_message_survives_a_round_trip(kind: str, data: st.DataObject) -> None:
    message = data.draw(strategy_for(MESSAGE_TYPES[kind]))

    decoded = decode_message(encode_message(message))

    assert decoded == message


@pytest.mark.parametrize(
    ("frame", "problem"),
    [
        ("{", "malformed json"),
        ("[1, 2]", "expected a JSON object"),
        ('{"kind": "nope"}', "unknown message kind 'nope'"),
        ('{"kind": "done", "lease_id": 1}', "missing field 'receipts'"),
        ('{"kind": "heartbeat", "extra": 1}', "unknown field 'extra'"),
        ('{"kind": "done", "lease_id": true, "receipts": [], "num_samples": 1, "loss_sum": 1, "compute_s": 1}',
         "lease_id: expected an integer"),
        ('{"kind": "done", "lease_id": 1, "receipts": [], "num_samples": 1, "loss_sum": NaN, "compute_s": 1}',
         "expected a finite number"),
        ('{"kind": "no_lease", "reason": "bored", "detail": "", "retry_after_s": 1}', "expected one of"),
    ],
)
def test_it_names_what_is_wrong_with_a_bad_frame(frame: str, problem: str) -> None:
    with pytest.raises(ProtocolError, match=problem):
        decode_message(frame)


def test_it_refuses_a_message_kind_not_meant_for_the_channel() -> None:
    frame = encode_message(LeaseDone(lease_id=1, receipts=[], num_samples=1, loss_sum=0.0, compute_s=0.0))

    with pytest.raises(ProtocolError, match="not accepted on this channel"):
        decode_message(frame, allowed=[])


def test_it_refuses_oversized_control_messages_before_parsing() -> None:
    frame = json.dumps({"kind": "heartbeat", "pad": "x" * (1 << 17)})

    with pytest.raises(ProtocolError, match="over the 65536 byte limit") as info:
        decode_message(frame)

    assert info.value.close_code == 4008
