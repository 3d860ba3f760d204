"""The daily stats export: every volunteer's and team's credit as one JSON document for third-party stats sites.

BOINC projects publish such dumps and sites like BOINCstats rank volunteers across projects from them; ours is
``/stats/stats.json``, rewritten once a day by Celery beat (``tasks.export_stats``). It names volunteers only by
their public name: never an e-mail address or a username, and a volunteer who hides their name appears as
``ANONYMOUS_NAME`` with an opaque id that stays the same from one export to the next.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime
from typing import IO, Any

from django.core.files import File
from django.core.files.storage import default_storage
from django.db.models import Count, Sum
from django.utils import timezone
from django.utils.crypto import salted_hmac

from crowdtrain.accounts.models import Profile, Team

from .models import FLOPS_PER_CREDIT, FORMULA, CreditEntry
from .summaries import RECENT_DAYS, recent_credit, recent_since

logger = logging.getLogger(__name__)

STATS_NAME = "stats/stats.json"  # in default storage; /stats/stats.json serves it
FORMAT = "crowdtrain-stats/1"
NOT_YET = "the first export has not run yet; it runs daily"


def _credit(flops: float | None) -> float:
    # To the FLOP (1e-9 credit): finer digits are float noise, like a reversal's -1e-20 left over.
    return round((flops or 0.0) / FLOPS_PER_CREDIT, 9) + 0.0  # + 0.0: -0.0 prints as 0.0


def anonymous_id(user_id: int) -> str:
    """An id for a volunteer who hides their name: the same in every export, and no way back to the account.

    Keyed with the site's secret key, so rotating that key gives anonymous volunteers new ids.
    """
    return "anon-" + salted_hmac("crowdtrain.credit.export.anonymous", str(user_id)).hexdigest()[:20]


def _users(since: datetime) -> Iterator[dict[str, Any]]:
    """One row per volunteer in the ledger, from a single GROUP BY query read in chunks."""
    rows = (
        CreditEntry.objects.values(
            "volunteer_id",
            "volunteer__profile__display_name",
            "volunteer__profile__anonymous",
            "volunteer__profile__team_id",
        )
        .annotate(
            total_flops=Sum("flops"),
            total_samples=Sum("samples"),
            recent_flops=Sum("flops", filter=recent_credit(since)),
        )
        .order_by("volunteer_id")
    )
    for row in rows.iterator(chunk_size=5000):
        # An unsaved Profile, so the public name follows the one rule in Profile.public_name; a volunteer
        # whose profile row is missing (an account older than profiles) gets its defaults.
        profile = Profile(
            user_id=row["volunteer_id"],
            display_name=row["volunteer__profile__display_name"] or "",
            anonymous=bool(row["volunteer__profile__anonymous"]),
        )
        if profile.anonymous:
            # Their team stays out too: a small team's credit would point at who they are.
            subject_id: int | str = anonymous_id(row["volunteer_id"])
            team_id = None
        else:
            subject_id, team_id = row["volunteer_id"], row["volunteer__profile__team_id"]
        yield {
            "id": subject_id,
            "name": profile.public_name,
            "team_id": team_id,
            "total_credit": _credit(row["total_flops"]),
            "samples": int(row["total_samples"] or 0),
            "recent_credit_per_day": _credit((row["recent_flops"] or 0.0) / RECENT_DAYS),
        }


def _teams(since: datetime) -> Iterator[dict[str, Any]]:
    """Every team, with the credit its members earned while in it (the ledger's team) and its members now."""
    # One row per team in each: as many rows as teams, not volunteers, so they fit in memory.
    credit = {
        team_id: (total, recent)
        for team_id, total, recent in CreditEntry.objects.filter(team__isnull=False)
        .values("team_id")
        .annotate(total_flops=Sum("flops"), recent_flops=Sum("flops", filter=recent_credit(since)))
        .order_by()
        .values_list("team_id", "total_flops", "recent_flops")
    }
    members = dict(
        Profile.objects.filter(team__isnull=False).values("team_id").annotate(n=Count("id")).values_list("team_id", "n")
    )
    for team_id, name in Team.objects.order_by("pk").values_list("pk", "name").iterator(chunk_size=5000):
        total, recent = credit.get(team_id, (0.0, 0.0))
        yield {
            "id": team_id,
            "name": name,
            "total_credit": _credit(total),
            "members": members.get(team_id, 0),
            "recent_credit_per_day": _credit((recent or 0.0) / RECENT_DAYS),
        }


def _write_array(out: IO[bytes], key: str, rows: Iterator[dict[str, Any]]) -> int:
    out.write(f',\n"{key}": ['.encode())
    count = 0
    for row in rows:
        out.write((",\n" if count else "\n").encode() + json.dumps(row, separators=(",", ":")).encode())
        count += 1
    out.write(b"\n]")
    return count


def write_document(out: IO[bytes], now: datetime | None = None) -> tuple[int, int]:
    """Write the stats document to ``out`` row by row; returns how many users and teams it holds."""
    now = now or timezone.now()
    since = recent_since(now)
    head = {
        "format": FORMAT,
        "generated_at": now.isoformat(),
        "credit": {
            "unit": "1 credit = 1 GFLOP",
            "flops_per_credit": FLOPS_PER_CREDIT,
            "formula": FORMULA,
        },
        "recent_days": RECENT_DAYS,
    }
    out.write(json.dumps(head, indent=1)[:-2].encode())  # left open: the arrays follow
    users = _write_array(out, "users", _users(since))
    teams = _write_array(out, "teams", _teams(since))
    out.write(b"\n}\n")
    return users, teams


def export_stats(now: datetime | None = None) -> str:
    """Write the document to default storage under ``STATS_NAME``; returns the name it was saved under.

    The document is complete in a local temporary file before the stored one is touched, so a failed
    export leaves yesterday's in place.
    """
    started = time.monotonic()
    with tempfile.TemporaryFile() as spool:
        users, teams = write_document(spool, now)
        spool.seek(0)
        # S3 (file_overwrite) replaces the object in one PUT: readers get the old document or the new one.
        # The local folder would save beside an existing file under another name, so that file goes
        # first, the moment before the finished document is copied in.
        if default_storage.get_available_name(STATS_NAME) != STATS_NAME:
            default_storage.delete(STATS_NAME)
        saved = default_storage.save(STATS_NAME, File(spool, name="stats.json"))
    logger.info("stats export: %s users and %s teams in %s (%.1f s)", users, teams, saved, time.monotonic() - started)
    return saved
