"""What the admins' review queue shows: quarantined volunteers with their record, appeal and recent failures."""

from __future__ import annotations

from dataclasses import dataclass

from django.db.models import F, Window
from django.db.models.functions import RowNumber

from crowdtrain.accounts.models import Profile

from .models import Answer, Standing

# Failed answers shown per volunteer: enough to see a pattern (one campaign, one device), short enough to scan.
RECENT_FAILURES = 5
RECENTLY_BANNED = 20


@dataclass(frozen=True)
class Entry:
    """One volunteer in the queue or the banned list."""

    standing: Standing
    public_name: str
    email: str
    failures: list[Answer]


def _public_names(user_ids: list[int]) -> dict[int, str]:
    names = {p.user_id: p.public_name for p in Profile.objects.filter(user_id__in=user_ids)}
    for standing in Standing.objects.filter(volunteer_id__in=set(user_ids) - names.keys()).select_related("volunteer"):
        names[standing.volunteer_id] = Profile.of(standing.volunteer).public_name  # users older than profiles
    return names


def _recent_failures(user_ids: list[int]) -> dict[int, list[Answer]]:
    """Each volunteer's latest answers that lost their check, newest first, in one query."""
    latest_first = Window(RowNumber(), partition_by=F("volunteer_id"), order_by=F("reported_at").desc(nulls_last=True))
    answers = (
        Answer.objects.filter(volunteer_id__in=user_ids, verdict=Answer.Verdict.DISAGREED)
        .select_related("case__campaign")
        .annotate(position=latest_first)
        .filter(position__lte=RECENT_FAILURES)
        .order_by("volunteer_id", "position")
    )
    found: dict[int, list[Answer]] = {}
    for answer in answers:
        found.setdefault(answer.volunteer_id, []).append(answer)
    return found


def _entries(rows: list[Standing], *, failures: bool) -> list[Entry]:
    ids = [row.volunteer_id for row in rows]
    names = _public_names(ids)
    recent = _recent_failures(ids) if failures else {}
    return [
        Entry(
            standing=row,
            public_name=names.get(row.volunteer_id, f"Volunteer {row.volunteer_id}"),
            email=row.volunteer.email,
            failures=recent.get(row.volunteer_id, []),
        )
        for row in rows
    ]


def quarantined() -> list[Entry]:
    """Everyone in quarantine, longest waiting first: a queue."""
    rows = Standing.objects.filter(state=Standing.State.QUARANTINED).select_related("volunteer")
    return _entries(list(rows.order_by(F("changed_at").asc(nulls_first=True), "pk")), failures=True)


def recently_banned() -> list[Entry]:
    rows = Standing.objects.filter(state=Standing.State.BANNED).select_related("volunteer", "reviewed_by")
    return _entries(list(rows.order_by(F("changed_at").desc(nulls_last=True), "-pk")[:RECENTLY_BANNED]), failures=False)
