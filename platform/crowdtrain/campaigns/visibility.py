"""Which campaigns a person may see and join: shared by the campaign pages, the credit pages and My devices."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet

from .models import Campaign
from .organizers import managed_campaigns


def can_watch(user: Any, campaign: Campaign) -> bool:
    """Drafts show only to whoever manages them; invite-only campaigns to their volunteers too."""
    if getattr(user, "is_authenticated", False) and managed_campaigns(user).filter(pk=campaign.pk).exists():
        return True
    return campaign.state != Campaign.State.DRAFT and campaign.is_open_to(user)


def open_campaigns() -> QuerySet[Campaign]:
    """The campaigns anyone may join, newest first: the home page's, and My devices' when it is empty.

    Invite-only campaigns are not advertised: their volunteers arrive through the invite link.
    """
    return (
        Campaign.objects.exclude(state__in=[Campaign.State.DRAFT, Campaign.State.ARCHIVED])
        .filter(visibility=Campaign.Visibility.PUBLIC)
        .order_by("-id")
    )
