"""The organizer role: who may create and run campaigns, how volunteers ask for it, how staff decide."""

from __future__ import annotations

import logging
from typing import Any

from django.contrib.auth.models import Group
from django.db import IntegrityError, transaction
from django.db.models import QuerySet
from django.utils import timezone

from .models import Campaign, OrganizerRequest

logger = logging.getLogger(__name__)

# Created by migration 0003; looked up with get_or_create so a database without it still works.
ORGANIZERS_GROUP = "organizers"


class RoleRequestError(ValueError):
    """A role request or decision that cannot be made; the message says why."""


def is_organizer(user: Any) -> bool:
    """Organizers run their own campaigns; staff (admins) count as organizers of every campaign."""
    if not getattr(user, "is_authenticated", False):
        return False
    return bool(user.is_staff) or user.groups.filter(name=ORGANIZERS_GROUP).exists()


def managed_campaigns(user: Any) -> QuerySet[Campaign]:
    """The campaigns ``user`` may see and manage: their own, or all of them for staff."""
    campaigns = Campaign.objects.select_related("owner", "dataset")
    return campaigns if user.is_staff else campaigns.filter(owner=user)


def pending_request(user: Any) -> OrganizerRequest | None:
    return OrganizerRequest.objects.filter(user=user, decision=OrganizerRequest.Decision.PENDING).first()


def request_role(user: Any, reason: str) -> OrganizerRequest:
    """File a request, or return the one already pending.

    Raises:
        RoleRequestError: if the user already is an organizer or gave no reason.
    """
    if is_organizer(user):
        raise RoleRequestError("you already have the organizer role")
    reason = reason.strip()
    if not reason:
        raise RoleRequestError("say in a sentence what you want to train, so an admin can decide")
    existing = pending_request(user)
    if existing is not None:
        return existing
    try:
        with transaction.atomic():
            created = OrganizerRequest.objects.create(user=user, reason=reason)
    except IntegrityError:  # a second tab filed one at the same moment
        return pending_request(user) or OrganizerRequest.objects.filter(user=user).first()  # type: ignore[return-value]
    logger.info("user %s asked for the organizer role", user.pk)
    return created


def decide(request_id: int, by: Any, *, grant: bool) -> OrganizerRequest:
    """Grant or refuse a pending request; granting puts the user in the organizers group.

    Raises:
        RoleRequestError: if the deciding user is not staff, or the request was already decided.
    """
    if not getattr(by, "is_staff", False):
        raise RoleRequestError("only admins decide organizer requests")
    with transaction.atomic():
        row = OrganizerRequest.objects.select_for_update().select_related("user").filter(pk=request_id).first()
        if row is None:
            raise RoleRequestError(f"there is no organizer request {request_id}")
        if row.decision != OrganizerRequest.Decision.PENDING:
            raise RoleRequestError(f"the request of {row.user} was already {row.decision}")
        row.decision = OrganizerRequest.Decision.GRANTED if grant else OrganizerRequest.Decision.REFUSED
        row.decided_by = by
        row.decided_at = timezone.now()
        row.save(update_fields=["decision", "decided_by", "decided_at"])
        if grant:
            grant_role(row.user)
    logger.info("organizer request %s %s by %s", row.pk, row.decision, by.pk)
    return row


def grant_role(user: Any) -> None:
    group, _ = Group.objects.get_or_create(name=ORGANIZERS_GROUP)
    user.groups.add(group)
