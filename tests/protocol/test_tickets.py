from __future__ import annotations

import time

import pytest

from crowdtrain_agent.protocol import ProtocolError, Ticket, sign_receipt, sign_ticket, verify_receipt, verify_ticket

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
    other, _ = sign_ticket(Ticket(**{**TICKET.__dict__, "num_samples": 6400}), b"attacker").split(".")

    with pytest.raises(ProtocolError, match="signature"):
        verify_ticket(f"{other}.{signature}", KEY)


def test_it_rejects_an_expired_ticket() -> None:
    token = sign_ticket(Ticket(**{**TICKET.__dict__, "expires_at": time.time() - 1}), KEY)

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
