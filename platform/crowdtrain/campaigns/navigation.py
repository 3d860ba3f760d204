"""What the site's navigation shows by role: Datasets for organizers, and staff's count of organizer requests."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.http import HttpRequest

from .models import OrganizerRequest
from .organizers import is_organizer


def navigation(request: HttpRequest) -> dict[str, Any]:
    """A template context processor (settings.TEMPLATES): base.html reads these on every page.

    Anonymous visitors cost no query; staff pay one count, so a request waiting for a decision
    shows as a badge wherever they are.
    """
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {"nav_is_organizer": False, "nav_pending_organizer_requests": 0}
    pending = 0
    if user.is_staff:
        pending = OrganizerRequest.objects.filter(decision=OrganizerRequest.Decision.PENDING).count()
    return {"nav_is_organizer": is_organizer(user), "nav_pending_organizer_requests": pending}


def contact(request: HttpRequest) -> dict[str, Any]:
    """The operator's address for pages that promise help (``CROWDTRAIN_CONTACT_EMAIL``; "" for none)."""
    return {"contact_email": settings.CROWDTRAIN_CONTACT_EMAIL}
