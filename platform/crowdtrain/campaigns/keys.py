"""Each campaign's own signing key, derived from the site's: the scheduler signs tickets with it, validation
and the aggregators check with it."""

from __future__ import annotations

from django.conf import settings

from crowdtrain_agent.protocol import campaign_key


def ticket_key(campaign_id: int) -> bytes:
    """The key of a campaign's tickets and receipts: its own (``protocol.campaign_key`` of the site's key).

    Aggregators learn it with a slice of the campaign (``assign.ticket_key``), so a leaked aggregator token
    signs only for that aggregator's campaigns. A site pinned to protocol 2.0 (CROWDTRAIN_PROTOCOL_MINOR=0)
    cannot send it and signs every campaign with CROWDTRAIN_TICKET_KEY itself, which its welcome carries.
    """
    if settings.CROWDTRAIN_PROTOCOL_MINOR < 1:
        return settings.CROWDTRAIN_TICKET_KEY
    return campaign_key(settings.CROWDTRAIN_TICKET_KEY, campaign_id)
