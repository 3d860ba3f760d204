"""E-mails about organizer requests: staff hear of each new one, the volunteer of its outcome.

Sent through the configured EMAIL_BACKEND. A mail server that is down must not
undo a request or a decision already saved: failures are logged, and the
pages (the navigation's badge, the request page) still tell everyone.
"""

from __future__ import annotations

import logging
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.mail import send_mail

from .models import OrganizerRequest

logger = logging.getLogger(__name__)


def _send(subject: str, body: str, to: list[str]) -> None:
    if not to:
        return
    try:
        send_mail(f"{settings.ACCOUNT_EMAIL_SUBJECT_PREFIX}{subject}", body, None, to)
    except Exception:  # any backend's failure: SMTP, DNS, a full disk for the file backend
        logger.exception("could not e-mail %s about an organizer request", ", ".join(to))


def staff_addresses() -> list[str]:
    users: Any = get_user_model().objects.filter(is_staff=True, is_active=True).exclude(email="")
    return sorted(users.values_list("email", flat=True))


def mail_staff_about(row: OrganizerRequest, decide_url: str) -> None:
    """Tell every active admin with an address that ``row`` waits for a decision at ``decide_url``."""
    who = row.user.email or row.user.get_username()
    body = f"{who} asks for the organizer role on Crowdtrain:\n\n{row.reason}\n\nGrant or refuse it at {decide_url}\n"
    _send(f"{who} asks to become an organizer", body, staff_addresses())


def mail_outcome(row: OrganizerRequest, site_url: str) -> None:
    """Tell the volunteer whether ``row`` was granted, and where to go next."""
    if row.decision == OrganizerRequest.Decision.GRANTED:
        subject = "You are now an organizer"
        body = (
            "An admin granted your request for the organizer role on Crowdtrain.\n\n"
            f"Upload a dataset and create a campaign at {site_url}campaigns/\n"
        )
    else:
        subject = "Your organizer request was refused"
        body = (
            "An admin refused your request for the organizer role on Crowdtrain. You can still lend your GPU "
            f"to any open campaign, and ask again with more detail at {site_url}organizers/request\n"
        )
    _send(subject, body, [row.user.email] if row.user.email else [])
