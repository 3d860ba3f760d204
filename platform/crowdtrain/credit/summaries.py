"""A volunteer's or a team's credit at a glance: totals, rank, a 7-day average, 30 days of daily credit, shares.

Every figure is read from the ledger (the rank from the leaderboards, which the ledger feeds) with a fixed number of
queries, each filtered on the (volunteer, created_at) or (team, created_at) index: a page costs what one subject's
entries cost, not what the whole ledger does.

Credit is placed in time by the work it pays for: a reversal counts on its grant's hour, as on the leaderboards. A
rolled-back step therefore takes its bar off the chart rather than pushing today below zero, and the recent average
is the 7-day leaderboard's credit divided by 7.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

from django.db.models import Exists, OuterRef, Q, QuerySet, Sum
from django.db.models.functions import TruncHour
from django.utils import timezone

from crowdtrain.accounts.models import ANONYMOUS_NAME, Profile

from . import boards
from .models import FLOPS_PER_CREDIT, CreditEntry

RECENT_DAYS = 7
CHART_DAYS = 30
# Shown on the pages next to the figure, so nobody has to guess whether it is BOINC's decaying RAC (it is not).
RECENT_DEFINITION = (
    f"Recent average is credit per day over the last {RECENT_DAYS} days: the credit for work done in the last "
    f"{RECENT_DAYS} × 24 hours (the current hour included), less any of it since taken back, divided by "
    f"{RECENT_DAYS}. It is not BOINC's exponentially decaying RAC."
)


@dataclass(frozen=True)
class Day:
    """One day's credit (in the site's time zone) for the chart."""

    day: date
    credit: float


@dataclass(frozen=True)
class Summary:
    """What a profile or team page shows of a subject's credit."""

    credit: float  # all time: grants less reversals
    samples: int  # all time, likewise
    recent_average: float  # credit per day, see RECENT_DEFINITION
    rank: int | None  # on the all-time board of every campaign; None without credit there
    days: list[Day]  # the last CHART_DAYS days, oldest first, today last, days without credit at zero


@dataclass(frozen=True)
class Share:
    """One volunteer's part of a team's credit: what they earned while in the team."""

    volunteer_id: int
    name: str  # the public name only: never the e-mail address or the username
    credit: float
    percent: float | None  # of the team's all-time credit; None when the team has none


def of_volunteer(volunteer_id: int, now: datetime | None = None) -> Summary:
    """A volunteer's credit: two queries on the (volunteer, created_at) index, and the leaderboard for the rank."""
    return _summarize(CreditEntry.objects.filter(volunteer_id=volunteer_id), "volunteers", volunteer_id, now)


def of_team(team_id: int, now: datetime | None = None) -> Summary:
    """A team's credit (work its members did while in it): two queries on the (team, created_at) index, and the rank."""
    return _summarize(CreditEntry.objects.filter(team_id=team_id), "teams", team_id, now)


def shares_of_team(team_id: int) -> list[Share]:
    """Each volunteer's part of the team's credit, largest first; they add up to the team's total.

    Former members are included: leaving a team takes no credit away from it.
    """
    rows = list(
        CreditEntry.objects.filter(team_id=team_id)
        .values("volunteer_id")
        .annotate(flops=Sum("flops"))
        .values_list("volunteer_id", "flops")
        .order_by()
    )
    credits = {volunteer: (flops or 0.0) / FLOPS_PER_CREDIT for volunteer, flops in rows}
    names = {p.user_id: p.public_name for p in Profile.objects.filter(user_id__in=list(credits))}
    total = sum(credits.values())
    shares = [
        Share(
            volunteer_id=volunteer,
            name=names.get(volunteer, ANONYMOUS_NAME),  # no profile yet: show nothing that identifies them
            credit=credit,
            percent=100.0 * credit / total if total > 1e-12 else None,
        )
        for volunteer, credit in credits.items()
    ]
    return sorted(shares, key=lambda s: (-s.credit, s.volunteer_id))


def _summarize(
    entries: QuerySet[CreditEntry], subject: boards.Subject, subject_id: int, now: datetime | None
) -> Summary:
    now = now or timezone.now()
    totals = entries.aggregate(flops=Sum("flops"), samples=Sum("samples"))
    hourly = _hourly_credit(entries, since=_chart_start(now))

    current_hour = boards.hour_of(now)
    # The same hours as the 7-day leaderboard: the current one and the 7 × 24 - 1 before it.
    recent = sum(credit for hour, credit in hourly.items() if hour > current_hour - RECENT_DAYS * 24)
    per_day: dict[date, float] = defaultdict(float)
    for hour, credit in hourly.items():
        per_day[timezone.localtime(datetime.fromtimestamp(hour * 3600, tz=UTC)).date()] += credit
    today = timezone.localdate(now)
    days = [today - timedelta(days=back) for back in range(CHART_DAYS - 1, -1, -1)]

    standing = boards.standing(boards.EVERY_CAMPAIGN, subject, "all", subject_id)
    return Summary(
        credit=(totals["flops"] or 0.0) / FLOPS_PER_CREDIT,
        samples=int(totals["samples"] or 0),
        recent_average=recent / RECENT_DAYS,
        rank=standing.rank if standing else None,
        days=[Day(day, per_day.get(day, 0.0)) for day in days],
    )


def recent_since(now: datetime) -> datetime:
    """The start of the recent window: the current hour and the ``RECENT_DAYS`` × 24 - 1 before it."""
    return datetime.fromtimestamp((boards.hour_of(now) - RECENT_DAYS * 24 + 1) * 3600, tz=UTC)


def recent_credit(since: datetime) -> Q:
    """Entries whose credit counts in the recent window: grants since ``since`` that were not taken back.

    A lease has at most one grant and one reversal taking all of it back, so this is the window's net credit
    with each reversal counted in its grant's hour (as the leaderboards count it).
    """
    reversal = CreditEntry.objects.filter(lease_id=OuterRef("lease_id"), kind=CreditEntry.Kind.REVERSAL)
    return Q(kind=CreditEntry.Kind.GRANT, created_at__gte=since) & ~Q(Exists(reversal))


def _chart_start(now: datetime) -> datetime:
    """Midnight (site time) starting the chart's first day; it lies before the 7-day window too."""
    first = timezone.localdate(now) - timedelta(days=CHART_DAYS - 1)
    return timezone.make_aware(datetime.combine(first, datetime.min.time()))


def _hourly_credit(entries: QuerySet[CreditEntry], since: datetime) -> dict[int, float]:
    """Credit per hour since ``since`` (hours since the epoch), a reversal counted in its grant's hour.

    A lease has at most one grant and one reversal that takes all of it back, so the grants not reversed are the
    net credit of their hours; the reversal check is one probe of the unique (lease, kind) index per grant.
    """
    reversal = CreditEntry.objects.filter(lease_id=OuterRef("lease_id"), kind=CreditEntry.Kind.REVERSAL)
    rows = (
        entries.filter(kind=CreditEntry.Kind.GRANT, created_at__gte=since)
        .exclude(Exists(reversal))
        .annotate(hour=TruncHour("created_at", tzinfo=UTC))
        .values("hour")
        .annotate(flops=Sum("flops"))
        .values_list("hour", "flops")
        .order_by()
    )
    return {boards.hour_of(hour): (flops or 0.0) / FLOPS_PER_CREDIT for hour, flops in rows}
