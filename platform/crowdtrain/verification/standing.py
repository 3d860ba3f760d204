"""Who may work, and how often their work is checked: cheap answers for the lease and report paths.

Standings change rarely and are read on every report, so each site process
keeps what it needs in memory: the quarantined and banned volunteers (reloaded
every few seconds, so a quarantine decided by another process takes effect
here within that time), each device's owner (noted when its socket is set
up) and each volunteer's record (read at first use, then reloaded at most a
minute later). A site process reloads the records in use in bulk, from its
housekeeping (``refresh_records``), before they are due: read one at a time,
5,000 volunteers each leasing twice a minute cost a query on most of their
reports.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from crowdtrain.accounts.models import Device

from .models import LOST_LAST_CHECK, NEWCOMER_CHECKS, Answer, Check, Standing

# A newcomer (fewer than NEWCOMER_CHECKS passed checks, ``models``) is checked four times as often.
# Passed checks in a row after which a volunteer's leases are checked a quarter as often.
TRUSTED_STREAK = 100
# A volunteer is quarantined at this many failed checks, if they are at least QUARANTINE_SHARE of their checks.
QUARANTINE_FAILURES = 2
QUARANTINE_SHARE = 0.1
# How a check's detail begins when its copy disagreed with the original (``checks.judge``): a dispute
# that holds a volunteer on probation (``held``), unlike a referral for a copier too like the original.
DISAGREEMENT = "the copy disagrees"
REFUSALS_TTL_S = 5.0
# The volunteer's standing page (URL name "standing"), named in refusals; a test checks the two agree.
STANDING_PATH = "/account/standing/"
RECORD_TTL_S = 60.0
# ``refresh_records`` reloads records this old, if read within RECORDS_IN_USE_S: due ones seldom remain.
RECORD_REFRESH_AT_S = RECORD_TTL_S / 2
RECORDS_IN_USE_S = 10 * RECORD_TTL_S
# What a held volunteer's agent is told (``held``).
DISPUTED = (
    "a result of yours and another volunteer's computation of the same lease disagree, and the site is "
    "recomputing that lease to rule on it; until it has, your agent computes copies of other volunteers' "
    "work, not new work for steps (nothing to do on your side: it resumes by itself once the ruling is in)"
)
LOST = (
    "the last of your results the site checked disagreed with its own recomputation; until one of your "
    "results passes a check, your agent computes copies of other volunteers' work, not new work for steps "
    f"(if your hardware computes differently, say so on {STANDING_PATH} on this site)"
)


@dataclass(frozen=True)
class Record:
    passed: int = 0
    streak: int = 0


_lock = threading.Lock()
_owners: dict[int, int] = {}
_records: dict[int, tuple[float, Record]] = {}
_records_used: dict[int, float] = {}  # volunteer -> when their record was last read here (monotonic)
_refusals: dict[int, str] = {}
_held: dict[int, str] = {}  # volunteer on probation -> why their work for steps waits (``held``)
_refusals_at = 0.0


def owner_of(device_id: int) -> int | None:
    """The volunteer who owns a device (devices never change hands)."""
    owner = _owners.get(device_id)
    if owner is None:
        owner = Device.objects.filter(pk=device_id).values_list("owner_id", flat=True).first()
        if owner is not None:
            _owners[device_id] = owner
    return owner


def note_owner(device_id: int, owner_id: int) -> None:
    """Remember a device's owner read elsewhere (its token check), so its reports need not read it again."""
    _owners[device_id] = owner_id


def owners_of(device_ids: Iterable[int]) -> dict[int, int]:
    """The owners of many devices, those not cached yet read in one query (a step's commit names a thousand)."""
    wanted = set(device_ids)
    missing = wanted - _owners.keys()
    if missing:
        _owners.update(Device.objects.filter(pk__in=missing).values_list("pk", "owner_id"))
    return {d: _owners[d] for d in wanted if d in _owners}


def check_rate(base: float, record: Record) -> float:
    """The share of a volunteer's leases to verify: more for newcomers, fewer after a long clean run."""
    if base <= 0:
        return 0.0
    if record.passed < NEWCOMER_CHECKS:
        return min(1.0, 4 * base)
    if record.streak >= TRUSTED_STREAK:
        return base / 4
    return min(1.0, base)


def probation(campaign_cap: int, organizer_id: int, volunteer_id: int | None) -> int:
    """The most leases of one step this volunteer may hold now (0: no limit).

    A newcomer's results are in steps before any check of them is decided, and a
    volunteer who is alone, or first, could fill whole steps: the robust rules
    outvote a minority, never a majority. So until ``NEWCOMER_CHECKS`` of their
    checks have passed, a volunteer holds no more of a step than the campaign's
    rule outvotes (``configs.probation_cap``). The organizer's own devices are
    exempt: a campaign's owner cannot poison it for anyone but themselves.
    """
    if campaign_cap <= 0 or volunteer_id is None or volunteer_id == organizer_id:
        return 0
    return campaign_cap if record_of(volunteer_id).passed < NEWCOMER_CHECKS else 0


def record_of(volunteer_id: int) -> Record:
    now = time.monotonic()
    _records_used[volunteer_id] = now
    cached = _records.get(volunteer_id)
    if cached is not None and now - cached[0] < RECORD_TTL_S:
        return cached[1]
    row = Standing.objects.filter(volunteer_id=volunteer_id).values_list("checks_passed", "streak").first()
    record = Record(*row) if row else Record()
    _records[volunteer_id] = (now, record)
    return record


def refresh_records(now: float | None = None, chunk: int = 5000) -> int:
    """Reload, a few queries for all, the records in use that will soon be due; returns how many.

    Records not read for ``RECORDS_IN_USE_S`` are dropped instead: their
    volunteers left, and the next read loads them afresh. ``now``: the monotonic clock's reading.
    """
    now = time.monotonic() if now is None else now
    for volunteer_id, used in list(_records_used.items()):
        if now - used > RECORDS_IN_USE_S:
            _records_used.pop(volunteer_id, None)
            _records.pop(volunteer_id, None)
    due = [v for v, (loaded, _) in list(_records.items()) if now - loaded >= RECORD_REFRESH_AT_S]
    for start in range(0, len(due), chunk):
        ids = due[start : start + chunk]
        found = Standing.objects.filter(volunteer_id__in=ids).values_list("volunteer_id", "checks_passed", "streak")
        rows = {volunteer: Record(passed, streak) for volunteer, passed, streak in found}
        for volunteer_id in ids:
            current = _records.get(volunteer_id)
            if current is not None and current[0] <= now:  # not remembered or forgotten meanwhile
                _records[volunteer_id] = (now, rows.get(volunteer_id, Record()))
    return len(due)


def remember(volunteer_id: int, record: Record) -> None:
    """This process changed the volunteer's record: keep the new one (its refusal did not change)."""
    _records[volunteer_id] = (time.monotonic(), record)


def forget(volunteer_id: int) -> None:
    """Read this volunteer's record and refusal again on next use (this process changed them)."""
    _records.pop(volunteer_id, None)
    global _refusals_at
    _refusals_at = 0.0


def clear_caches() -> None:
    """Forget every cached owner, record and refusal (tests, whose rolled-back ids come back)."""
    global _refusals_at
    _owners.clear()
    _records.clear()
    _records_used.clear()
    _refusals.clear()
    _held.clear()
    _refusals_at = 0.0


def reload_soon() -> None:
    """Read refusals and holds again on next use (a ruling changed who is held)."""
    global _refusals_at
    _refusals_at = 0.0


def note_disputed(volunteer_ids: Iterable[int]) -> None:
    """This process sent a disagreement to the referee: hold its volunteers now, not at the next reload."""
    for volunteer_id in volunteer_ids:
        _held.setdefault(volunteer_id, DISPUTED)


def refusal(volunteer_id: int | None) -> str:
    """Why this volunteer may not work now ("" if they may), in words for their agent's log."""
    if volunteer_id is None:
        return ""
    _reload_if_due()
    return _refusals.get(volunteer_id, "")


def held(volunteer_id: int | None) -> str:
    """Why this volunteer's work for steps waits ("" if it does not): a newcomer under suspicion.

    A newcomer's results go into steps before their checks are decided, and
    the referee that decides a dispute may take minutes on a loaded site:
    hostile newcomers kept filling steps while their rulings waited, and their
    harm grew with the referee's delay. So a volunteer on
    probation (the caller asks ``probation`` first) whose result is disputed
    by a copy, or whose last decided check failed, gets no new leases for
    steps until the dispute is ruled or a check passes; copies of others' work
    stay open to them, which is how an honest newcomer unlucky in one check
    passes the next. Honest volunteers in an honest crowd never disagree, so
    this costs them nothing; a hostile newcomer's harm ends at its first
    disagreement instead of at its second lost ruling.
    """
    if volunteer_id is None:
        return ""
    _reload_if_due()
    return _held.get(volunteer_id, "")


def _reload_if_due() -> None:
    """Refusals and holds, read for all volunteers at once every ``REFUSALS_TTL_S``: not a query per lease."""
    global _refusals, _held, _refusals_at
    now = time.monotonic()
    if now - _refusals_at <= REFUSALS_TTL_S:
        return
    with _lock:
        if now - _refusals_at <= REFUSALS_TTL_S:
            return
        rows = Standing.objects.exclude(state=Standing.State.GOOD).values_list("volunteer_id", "state", "reason")
        refusals = {v: explain(state, reason) for v, state, reason in rows}
        _refusals, _held, _refusals_at = refusals, _load_holds(refusals), now


def _load_holds(refused: dict[int, str]) -> dict[int, str]:
    """Volunteers on probation with a disagreement before the referee, or whose last decided check failed."""
    holds: dict[int, str] = {}
    holds.update(dict.fromkeys(Standing.objects.filter(LOST_LAST_CHECK).values_list("volunteer_id", flat=True), LOST))
    # Proven volunteers among them are not held: the lease path asks ``probation`` first.
    disputed = Answer.objects.filter(
        case__state=Check.State.REFEREE, case__detail__startswith=DISAGREEMENT
    ).values_list("volunteer_id", flat=True)
    holds.update(dict.fromkeys(disputed, DISPUTED))
    for volunteer_id in refused:
        holds.pop(volunteer_id, None)  # refused outright: ``refusal`` says why
    return holds


def explain(state: str, reason: str) -> str:
    """What a refused agent is told: why, and where to appeal."""
    page = f"{STANDING_PATH} on this site"
    if state == Standing.State.BANNED:
        return f"this account is banned from computing ({reason}); see {page}"
    return (
        f"this account is quarantined: {reason}. Its work is not used and its credit is on hold while an admin "
        f"reviews it; read why and appeal at {page}. The agent keeps asking and resumes if the account is cleared"
    )
