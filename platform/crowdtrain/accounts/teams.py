"""Team membership: create, join by invite code, leave; one team per volunteer."""

from __future__ import annotations

import logging
from typing import Any

from django.db import transaction

from .models import Profile, Team

logger = logging.getLogger(__name__)


class AlreadyInTeam(Exception):
    """The volunteer must leave their current team first."""

    def __init__(self, team: Team) -> None:
        super().__init__(f"already a member of {team.name!r}")
        self.team = team


def team_for_invite(code: str) -> Team | None:
    """The team whose *current* invite code this is; rotated codes find nothing."""
    return Team.objects.filter(invite_code=code).first() if code else None


@transaction.atomic
def create_team(creator: Any, name: str, description: str = "") -> Team:
    """Create a team and make its creator the first member.

    Raises:
        AlreadyInTeam: the creator belongs to a team; creating would silently move them.
    """
    profile = Profile.objects.select_for_update().get(pk=Profile.of(creator).pk)
    if profile.team is not None:  # no query when team_id is None
        raise AlreadyInTeam(profile.team)
    team = Team.objects.create(name=name, description=description, created_by=creator)
    profile.team = team
    profile.save(update_fields=["team"])
    logger.info("team %s created by user %s", team.slug, creator.pk)
    return team


@transaction.atomic
def join_team(user: Any, team: Team, *, leave_current: bool = False) -> bool:
    """Put the volunteer in ``team``; returns False when they already were in it.

    Raises:
        AlreadyInTeam: they belong to another team and ``leave_current`` is False.
    """
    profile = Profile.objects.select_for_update().get(pk=Profile.of(user).pk)
    if profile.team_id == team.pk:
        return False
    if not leave_current and profile.team is not None:
        raise AlreadyInTeam(profile.team)
    profile.team = team
    profile.save(update_fields=["team"])
    logger.info("user %s joined team %s", user.pk, team.slug)
    return True


def leave_team(user: Any, team: Team) -> bool:
    """Take the volunteer out of ``team``; returns False when they were not in it."""
    left = Profile.objects.filter(user=user, team=team).update(team=None)
    if left:
        logger.info("user %s left team %s", user.pk, team.slug)
    return bool(left)
