from __future__ import annotations

import time

import msgspec
import pytest

from crowdtrain_agent.protocol import (
    ProtocolError,
    Ticket,
    campaign_key,
    sign_receipt,
    sign_ticket,
    ticket_campaign,
    verify_receipt,
    verify_ticket,
)

KEY = b"k" * 32
# Expires in a day: the module is imported at collection, long before the test runs.
TICKET = Ticket(lease_id=7, campaign_id=1, device_id=3, base_version=2, num_samples=64, expires_at=time.time() + 86400)


def test_a_signed_ticket_verifies_to_its_contents() -> None:
    assert verify_ticket(sign_ticket(TICKET, KEY), KEY) == TICKET


def test_it_rejects_a_ticket_signed_with_another_key() -> None:
    with pytest.raises(ProtocolError, match="signature does not verify"):
        verify_ticket(sign_ticket(TICKET, b"x" * 32), KEY)


def test_it_rejects_a_ticket_whose_payload_was_edited() -> None:
    payload, signature = sign_ticket(TICKET, KEY).split(".")
    other, _ = sign_ticket(msgspec.structs.replace(TICKET, num_samples=6400), b"attacker").split(".")

    with pytest.raises(ProtocolError, match="signature"):
        verify_ticket(f"{other}.{signature}", KEY)


def test_it_rejects_an_expired_ticket() -> None:
    token = sign_ticket(msgspec.structs.replace(TICKET, expires_at=time.time() - 1), KEY)

    with pytest.raises(ProtocolError, match="has expired"):
        verify_ticket(token, KEY)


@pytest.mark.parametrize("token", ["", "no-dot", "a.b.c", "!!!.???"])
def test_it_rejects_garbage_tickets(token: str) -> None:
    with pytest.raises(ProtocolError, match="bad ticket"):
        verify_ticket(token, KEY)


def test_a_receipt_is_bound_to_its_lease_slice_and_sample_count() -> None:
    receipt = sign_receipt(KEY, campaign_id=1, lease_id=7, slice_index=0, num_samples=64)

    assert verify_receipt(receipt, KEY, campaign_id=1, lease_id=7, slice_index=0, num_samples=64)
    assert not verify_receipt(receipt, KEY, campaign_id=1, lease_id=8, slice_index=0, num_samples=64)
    assert not verify_receipt(receipt, KEY, campaign_id=1, lease_id=7, slice_index=1, num_samples=64)
    assert not verify_receipt(receipt, KEY, campaign_id=1, lease_id=7, slice_index=0, num_samples=65)


def test_each_campaign_has_its_own_key_and_a_ticket_names_its_campaign() -> None:
    first, second = campaign_key(KEY, 1), campaign_key(KEY, 2)

    assert len({first, second, KEY}) == 3 and len(first) == 32 and campaign_key(KEY, 1) == first
    assert ticket_campaign(sign_ticket(TICKET, first)) == TICKET.campaign_id
    with pytest.raises(ProtocolError, match="signature does not verify"):
        verify_ticket(sign_ticket(TICKET, second), first)
    for junk in ("", "x.y", "e30.x", "eyJjYW1wYWlnbl9pZCI6ICIxIn0.x"):  # not JSON; {}; {"campaign_id": "1"}
        with pytest.raises(ProtocolError, match="bad ticket"):
            ticket_campaign(junk)
