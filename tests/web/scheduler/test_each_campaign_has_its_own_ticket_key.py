"""A campaign's tickets and receipts are signed with its own key, so an aggregator token signs for its campaigns only.

An aggregator learns a campaign's key with a slice of it (``assign.ticket_key``);
a receipt signed with another campaign's key is refused like a forged one.
"""

from __future__ import annotations

import pytest
from django.test import override_settings

from crowdtrain.campaigns.keys import ticket_key
from crowdtrain.scheduler import leasing, reporting
from crowdtrain_agent.protocol import LeaseDone, ProtocolError, Receipt, campaign_key, sign_receipt, verify_ticket
from tests.factories import make_campaign, make_device

pytestmark = pytest.mark.django_db


def _done(lease: object, key: bytes) -> LeaseDone:
    receipts = [Receipt(slice_index=0, token=sign_receipt(key, campaign_id=lease.campaign_id, lease_id=lease.lease_id,
                                                          slice_index=0, num_samples=lease.num_samples))]  # fmt: skip
    return LeaseDone(lease_id=lease.lease_id, receipts=receipts, num_samples=lease.num_samples,
                     loss_sum=float(lease.num_samples), compute_s=0.1)  # fmt: skip


def test_a_receipt_signed_with_another_campaigns_key_is_refused() -> None:
    first, second = make_campaign(), make_campaign()
    device, _ = make_device()
    lease, next_lease = leasing.request_lease(device.pk, None, None), leasing.request_lease(device.pk, None, None)
    other = first.pk if lease.campaign_id == second.pk else second.pk

    forged = reporting.report_done(device.pk, _done(lease, ticket_key(other)))  # a rejected lease is done with
    honest = reporting.report_done(device.pk, _done(next_lease, ticket_key(next_lease.campaign_id)))

    assert not forged.ack.accepted and "invalid receipt for slice 0" in forged.ack.reason
    assert honest.ack.accepted


def test_a_ticket_verifies_only_with_its_own_campaigns_key() -> None:
    first, second = make_campaign(), make_campaign()
    device, _ = make_device()
    lease = leasing.request_lease(device.pk, None, None)
    other = first.pk if lease.campaign_id == second.pk else second.pk

    assert verify_ticket(lease.ticket, ticket_key(lease.campaign_id)).campaign_id == lease.campaign_id
    for key in (ticket_key(other), leasing.settings.CROWDTRAIN_TICKET_KEY):
        try:
            verify_ticket(lease.ticket, key)
        except ProtocolError as exc:
            assert "signature does not verify" in str(exc)
        else:
            raise AssertionError("a ticket verified with a key other than its campaign's")
    # Derived from the site's key, never equal to it, and distinct per campaign.
    assert ticket_key(first.pk) == campaign_key(leasing.settings.CROWDTRAIN_TICKET_KEY, first.pk)
    assert len({ticket_key(first.pk), ticket_key(second.pk), leasing.settings.CROWDTRAIN_TICKET_KEY}) == 3


def test_a_site_pinned_to_2_0_signs_every_campaign_with_its_one_key() -> None:
    with override_settings(CROWDTRAIN_PROTOCOL_MINOR=0):
        campaign = make_campaign()
        device, _ = make_device()
        lease = leasing.request_lease(device.pk, None, None)

        assert ticket_key(campaign.pk) == leasing.settings.CROWDTRAIN_TICKET_KEY
        assert verify_ticket(lease.ticket, leasing.settings.CROWDTRAIN_TICKET_KEY).campaign_id == campaign.pk
