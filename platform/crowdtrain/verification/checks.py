"""Verification by replication: pick leases, hand copies to other volunteers, compare sketches, judge.

A share of reported leases (``standing.check_rate``) becomes a *check*. Its
copy waits in a short Redis queue per campaign and is served, before new
work, to the next agent of another volunteer that asks, one unlike the
original's for a while (``affinity``), and one request of such a volunteer
waiting for a commit is woken to take it; the copy trains on the original's
samples and base version and uploads as any lease does, but its ticket says
``check``, so the aggregators only sketch it. Two sketches of unlike
volunteers that agree pass the check. A disagreement, an agreement with a
similar volunteer, and a check nobody copied in time go to the referee, the
operator's own recomputation (``referee``), which judges each answer: a vote
among volunteers decides nothing against anyone. A lease's credit waits for
its check; a volunteer who loses rulings is quarantined (``quarantine``).

Nothing here runs unless a lease is picked, except one random draw per report
and, per lease request while copies wait, one short Redis call and the asking
volunteer's tags (``affinity``, read once a minute per volunteer): the cost of the
hot paths does not grow with volunteers or leases in flight. Handing out a
copy and taking its report read no row: the queue entry carries the copy's
samples, the lease-to-campaign map carries who holds it (``copy_marker``), and
its row is written with the scheduler's batched records (its report at once).
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar, cast

import msgspec
from asgiref.sync import async_to_sync
from django.conf import settings
from django.db import transaction
from django.db.models import Count, Exists, Model, OuterRef, Q, QuerySet
from django.utils import timezone
from kombu.exceptions import OperationalError

from crowdtrain.credit import ledger
from crowdtrain.lib import batchsql
from crowdtrain.scheduler import ids
from crowdtrain.scheduler.configs import CampaignConfig, campaign_config
from crowdtrain.scheduler.hotrecords import LeaseRecord
from crowdtrain.scheduler.hotstate import hot_state
from crowdtrain.scheduler.models import Lease
from crowdtrain_agent.protocol import Lease as LeaseMessage
from crowdtrain_agent.protocol import LeaseDone, receipt_sketch, retained_versions
from crowdtrain_agent.sketch import SKETCH_SIZE, Agreement, compare, from_bytes

from . import affinity, referee, standing
from .models import Answer, Check, Standing

M = TypeVar("M", bound=Model)

logger = logging.getLogger(__name__)

# Waiting copies a lease request looks through for one its volunteer may take.
SCAN = 16
# A campaign whose queue of copies was empty is not asked again for this long by this process: lease
# requests then cost no Redis call of their own (a copy waits CROWDTRAIN_CHECK_WAIT_S, so a fraction
# of a second before it is noticed costs nothing).
EMPTY_RECHECK_S = 0.25
_empty_until: dict[int, float] = {}


class CopyEntry(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A copy of a check waiting in its campaign's queue in Redis (``lua/take_copy.lua`` reads the short keys).

    It carries what the copy's lease is made of, so handing it out reads no row. Entries written before
    2.9 have only ``c``, ``x``, ``u`` and ``v``.
    """

    check: int = msgspec.field(name="c")  # the check's id
    excluded: list[int] = msgspec.field(
        name="x"
    )  # volunteers who may never take it (always written: the script reads it)
    until: float = msgspec.field(name="u")  # stale past this (seconds since the epoch): nobody took it in time
    base_version: int | None = msgspec.field(name="v", default=None)  # the version the original computed on
    samples: int | None = msgspec.field(name="n", default=None)
    role: str | None = msgspec.field(name="r", default=None)  # Answer.Role of the copy
    ranges: list[Any] | None = msgspec.field(name="g", default=None)  # the original lease's shard ranges
    tags: list[str] | None = msgspec.field(name="a", default=None)  # the original volunteer's (``affinity``)
    similar_after: float | None = msgspec.field(name="w", default=None)  # a similar volunteer may take it from
    similar: int = msgspec.field(name="s", default=0)  # 1: a similar volunteer took it (set by the script)


def _queue_key(campaign_id: int) -> str:
    return f"{hot_state().prefix}:chk:{campaign_id}"


@dataclass(frozen=True)
class CopyHolder:
    """Who computes a copy, and of which check: what its report or release needs, read from Redis, not a row."""

    check_id: int
    role: str  # Answer.Role: copy (tiebreak for queue entries written before the referee)
    volunteer_id: int
    device_id: int
    num_samples: int
    similar: bool = False  # its volunteer shares a trait with the original's (``affinity``)

    def answer(self, lease_id: int, **reported: Any) -> Answer:
        """The copy's answer row (``reported``: the fields of its report, if it came)."""
        return Answer(
            case_id=self.check_id,
            lease_id=lease_id,
            role=self.role,
            volunteer_id=self.volunteer_id,
            device_id=self.device_id,
            similar=self.similar,
            **reported,
        )


def copy_marker(campaign_id: int, holder: CopyHolder | None = None) -> str:
    """What the lease-to-campaign map holds for a copy: its campaign, marked, and who holds it.

    The marker is written by ``lua/take_copy.lua`` in the same form; copies issued before 2.9 have the bare
    ``campaign:check``, and their holder is read from the record.
    """
    if holder is None:
        return f"{campaign_id}:check"
    who = f"{holder.check_id}:{holder.role}:{holder.volunteer_id}:{holder.device_id}:{holder.num_samples}"
    return f"{campaign_id}:check:{who}" + (":1" if holder.similar else "")


def is_copy_marker(text: str) -> bool:
    return text.split(":", 2)[1:2] == ["check"]


def _holder(marker: str) -> CopyHolder | None:
    """The holder a copy marker names; None for a bare (pre-2.9) or malformed one."""
    parts = marker.split(":")
    if len(parts) not in (7, 8) or parts[3] not in (Answer.Role.COPY, Answer.Role.TIEBREAK):
        return None
    numbers = [parts[k] for k in (2, 4, 5, 6)]
    if not all(part.isascii() and part.isdigit() for part in numbers):
        return None
    check_id, volunteer_id, device_id, num_samples = (int(part) for part in numbers)
    return CopyHolder(check_id, parts[3], volunteer_id, device_id, num_samples, similar=parts[7:] == ["1"])


def _holder_on_record(lease_id: int) -> CopyHolder | None:
    """The holder of an unreported copy from its answer row: for a bare marker, or none at all."""
    row = (
        Answer.objects.filter(lease_id=lease_id, reported_at__isnull=True)
        .exclude(role=Answer.Role.ORIGINAL)
        .values_list("case_id", "role", "volunteer_id", "device_id", "case__num_samples", "similar")[:1]
    )
    found = next(iter(row), None)
    if found is None or found[3] is None:
        return None
    return CopyHolder(*found)


# ------------------------------------------------------------------ picking


def sketch_of(config: CampaignConfig, done: LeaseDone) -> list[float] | None:
    """The aggregators' sketches of a lease (receipts verified already), in slice order; None if one lacks it."""
    tokens = {r.slice_index: r.token for r in done.receipts}
    values: list[float] = []
    for route in config.slices:
        try:
            part = from_bytes(receipt_sketch(tokens[route.index]))
        except (KeyError, ValueError):
            return None
        if len(part) != SKETCH_SIZE:
            return None  # an aggregator older than protocol 2.2 signs receipts without one
        values += part
    return values


def maybe_pick(config: CampaignConfig, device_id: int, done: LeaseDone, record: LeaseRecord) -> bool:
    """Pick an accepted lease for verification at the volunteer's rate; whether it was (its credit then waits)."""
    base = config.check_fraction
    owner = standing.owner_of(device_id)
    if base <= 0 or owner is None or random.random() >= standing.check_rate(base, standing.record_of(owner)):
        return False
    sketch = sketch_of(config, done)
    if sketch is None:
        return False  # nothing to compare with: an aggregator that does not sketch yet
    from crowdtrain.scheduler.lease_rows import to_shards

    case = Check(
        campaign_id=config.id,
        lease_id=done.lease_id,
        volunteer_id=owner,
        base_version=record.base_version,
        ranges=to_shards(config.table, record.ranges),
        num_samples=record.samples,
    )
    original = Answer(
        lease_id=done.lease_id,
        role=Answer.Role.ORIGINAL,
        volunteer_id=owner,
        device_id=device_id,
        sketch=sketch,
        reported_at=timezone.now(),
    )
    case.pk = batchsql.open_check(case, original)
    referee.keep(config.id, case.base_version)  # until the check closes: a dispute may come after the aggregators
    _enqueue(case, [owner])
    logger.info("campaign %s: lease %s picked for verification (check %s)", config.id, done.lease_id, case.pk)
    return True


def oldest_copyable(open_step: int, staleness: int) -> int:
    """The oldest base version a copy can still train on when step ``open_step`` is open.

    Aggregators keep the parameters of ``retained_versions(staleness)`` versions below
    the newest they applied, which trails ``open_step`` by a version or so while a commit is
    applied: one version of that lag is allowed for, as a copy served in doubt costs one failed
    download while a check dropped in doubt costs a verification. A copy of an older lease would
    fetch parameters that are gone (410) and come back undone, over and over, keeping its
    volunteer from real work; such a check ends with no verdict instead (its lease is credited,
    as for any check nobody answered).
    """
    return open_step - retained_versions(staleness)


def _enqueue(case: Check, excluded: list[int]) -> None:
    """Queue a copy of the check for a volunteer not in ``excluded``.

    The entry carries what a copy's lease is made of (samples, base version, role), so handing
    it out reads no row: that took two queries per copy, on the lease path of every copy.
    """
    now = hot_state().clock()
    role = Answer.Role.TIEBREAK if case.state == Check.State.TIEBREAK else Answer.Role.COPY
    entry = CopyEntry(
        check=case.pk,
        excluded=excluded,
        until=now + settings.CROWDTRAIN_CHECK_WAIT_S,
        base_version=case.base_version,
        samples=case.num_samples,
        role=str(role),
        ranges=list(case.ranges),
        # Who the original's volunteer is like, and from when such a volunteer may take the copy anyway.
        tags=affinity.tags_of(case.volunteer_id, widen=True),
        similar_after=now + settings.CROWDTRAIN_CHECK_SIMILAR_WAIT_S,
    )
    hot_state().client.rpush(_queue_key(case.campaign_id), msgspec.json.encode(entry))
    _empty_until.pop(case.campaign_id, None)
    # Once the check's rows are committed, so the called request reads them.
    transaction.on_commit(lambda: _call_a_volunteer(case.campaign_id, excluded))


def _call_a_volunteer(campaign_id: int, excluded: list[int]) -> None:
    """Wake one request waiting for a commit, of a volunteer who may take the copy (``parking.wake_for_copy``)."""
    from crowdtrain.scheduler import seam
    from crowdtrain.scheduler.parking import wake_for_copy

    channels = wake_for_copy(campaign_id, excluded)
    if channels:  # through the sockets' door in the scheduler's seam: the gateway is above verification
        async_to_sync(seam.publisher().wake)(campaign_id, channels, copy=True)


def copies_may_wait(campaign_id: int) -> None:
    """Look in the campaign's queue of copies at this process's next lease request (a woken one is coming)."""
    _empty_until.pop(campaign_id, None)


def _only(rows: QuerySet[M]) -> M | None:
    """The row of a lookup by a unique key, or None.

    Not ``first()``: on an unordered query it adds ``ORDER BY id``, and Django
    compiling that ordering showed in a busy site process's profile.
    """
    return next(iter(rows[:1]), None)


# ------------------------------------------------------------------ copies


def take_copy(config: CampaignConfig, device_id: int) -> LeaseMessage | None:
    """A waiting copy this device may compute (never its own volunteer's lease), as a lease; None if none waits.

    Reads no row: the queue entry holds the copy's samples, and its answer row is written with the
    scheduler's batched records (``records.RecordWriter.copy_issued``).
    """
    now = time.monotonic()
    if _empty_until.get(config.id, 0.0) > now:
        return None
    state = hot_state()
    key = _queue_key(config.id)
    pipe = state.client.pipeline(transaction=False)
    pipe.exists(key)
    pipe.hget(state.campaign_key(config.hot_key) + "meta", "open")
    waiting, open_step = pipe.execute()
    if not waiting:
        _empty_until[config.id] = now + EMPTY_RECHECK_S
        return None
    owner = standing.owner_of(device_id)
    if owner is None:
        return None
    oldest = oldest_copyable(int(open_step or 0), config.staleness)
    copy_id = ids.lease_ids.take()
    raw = state.standalone("take_copy")(
        keys=[key, state.lease_campaigns_key],
        args=[
            repr(state.clock()),
            str(owner),
            str(SCAN),
            str(oldest),
            str(copy_id),
            str(config.id),
            str(device_id),
            json.dumps(affinity.tags_of(owner)),
        ],
    )
    answer = json.loads(cast(str, raw))
    for check_id in answer.get("stale") or []:
        unanswered(int(check_id), "no volunteer of another account took its copy in time")
    for check_id in answer.get("gone") or []:
        unanswered(int(check_id), "its base version left the aggregators' window before a copy")
    entry = msgspec.json.decode(answer["chosen"], type=CopyEntry, strict=False) if answer.get("chosen") else None
    taken = None if entry is None else _taken(config, entry, owner, device_id, copy_id)
    if taken is None:
        ids.lease_ids.put_back(copy_id)
        return None
    holder, base_version, ranges = taken
    from crowdtrain.scheduler.leasing import lease_message
    from crowdtrain.scheduler.records import writer

    writer().copy_issued(holder.answer(copy_id))
    deadline = timezone.now() + timedelta(seconds=settings.CROWDTRAIN_LEASE_MAX_DEADLINE_S)
    lease = Lease(
        pk=copy_id,
        campaign_id=config.id,
        device_id=device_id,
        base_version=base_version,
        ranges=ranges,
        num_samples=holder.num_samples,
        deadline=deadline,
    )
    logger.info("campaign %s: lease %s is a %s for check %s", config.id, copy_id, holder.role, holder.check_id)
    return lease_message(lease, config, check=True)


def _taken(
    config: CampaignConfig, entry: CopyEntry, owner: int, device_id: int, copy_id: int
) -> tuple[CopyHolder, int, list[Any]] | None:
    """The copy a queue entry stands for: its holder, base version and samples; None if it is not to be served.

    An entry from before 2.9 names only its check, so the check is read; the record then decides who
    may take it, as the entry's list of excluded volunteers might disagree with it.
    """
    if entry.samples is not None and entry.role is not None and entry.ranges is not None:
        holder = CopyHolder(entry.check, entry.role, owner, device_id, entry.samples, bool(entry.similar))
        return holder, int(entry.base_version or 0), list(entry.ranges)
    case = _only(Check.objects.filter(pk=entry.check))
    if case is None or not case.open:
        return None
    answered = set(case.answers.values_list("volunteer_id", flat=True))
    if owner in answered:
        _enqueue(case, sorted(answered))  # the copy waits for someone the record allows
        return None
    role = Answer.Role.TIEBREAK if case.state == Check.State.TIEBREAK else Answer.Role.COPY
    holder = CopyHolder(case.pk, str(role), owner, device_id, case.num_samples)
    state = hot_state()
    state.client.hset(state.lease_campaigns_key, str(copy_id), copy_marker(config.id, holder))
    return holder, case.base_version, list(case.ranges)


def copy_done(config: CampaignConfig, device_id: int, done: LeaseDone, problem: str, marker: str) -> str:
    """Record a copy's report and have its check judged; returns why it is refused ("" if it was taken).

    ``marker``: the copy's entry in the lease-to-campaign map (``copy_marker``), which says who holds it.
    The report is written at once, not with the batched records: a disagreeing copy calls a third
    one, which must be served while aggregators still keep the lease's base version (in a campaign of
    sub-second steps, a quarter second's wait for the batch had its checks end undecided).
    """
    holder = _holder(marker) or _holder_on_record(done.lease_id)
    if holder is None or holder.device_id != device_id:
        return "unknown lease"  # another device's copy looks the same as no lease at all
    state = hot_state()
    if not state.client.hdel(state.lease_campaigns_key, str(done.lease_id)):
        return "lease already reported"  # by a report that came just before this one
    now = timezone.now()
    if problem or done.num_samples != holder.num_samples:
        problem = problem or f"lease has {holder.num_samples} samples, report says {done.num_samples}"
        _write_report(holder.answer(done.lease_id, reported_at=now, verdict=Answer.Verdict.NONE))
        _requeue_or_abandon(
            holder.check_id, holder.volunteer_id, done.lease_id, f"a copy's report was refused: {problem}"
        )
        return problem
    sketch = sketch_of(config, done)
    verdict = Answer.Verdict.PENDING if sketch else Answer.Verdict.NONE
    _write_report(holder.answer(done.lease_id, reported_at=now, sketch=sketch or [], verdict=verdict))
    if sketch is None:
        why = "a copy came back without sketches (an aggregator older than 2.2)"
        _requeue_or_abandon(holder.check_id, holder.volunteer_id, done.lease_id, why)
    else:
        _judge_soon(holder.check_id)  # the answer is written: the report path runs in autocommit
    return ""


def _write_report(answer: Answer) -> None:
    """A copy's report over its answer row, or as the row where it is not written yet (the process that
    issued the copy writes it with its next batch of records, and then leaves this one as it is)."""
    Answer.objects.bulk_create(
        [answer],
        update_conflicts=True,
        unique_fields=["lease_id"],
        update_fields=["reported_at", "sketch", "verdict", "similar"],
    )


def _judge_soon(check_id: int) -> None:
    """Judge in the Celery worker: the report's ack does not wait for a verdict, and a verdict's dozen queries
    (answers, standings, credit, maybe a quarantine) would weigh on the processes that hold the sockets.
    Without a broker (the embedded default) the task runs here at once; with one that is
    down, here too. A check whose task was lost is judged by the periodic ``upkeep`` (``judge_ripe``).
    """
    from .tasks import judge_check

    try:
        judge_check.delay(check_id)
    except (OperationalError, OSError):  # the broker is away (in eager mode a verdict's own error propagates)
        logger.warning("check %s: could not hand the verdict to the worker; judging it here", check_id, exc_info=True)
        judge(check_id)


RIPE_AFTER_S = 60.0  # a check with two answers in for this long lost its task (a worker or broker was down)


def judge_ripe() -> int:
    """Judge checks whose answers are in but whose verdict never came; returns how many were looked at."""
    ripe = list(
        Check.objects.filter(state__in=(Check.State.OPEN, Check.State.TIEBREAK))
        .annotate(
            waiting=Count(
                "answers",
                filter=Q(
                    answers__verdict=Answer.Verdict.PENDING,
                    answers__reported_at__lt=timezone.now() - timedelta(seconds=RIPE_AFTER_S),
                ),
            )
        )
        .filter(waiting__gte=2)
        .values_list("pk", flat=True)[:500]
    )
    for check_id in ripe:
        judge(check_id)
    return len(ripe)


def copy_released(lease_id: int, reason: str, *, device_id: int | None = None, marker: str = "") -> None:
    """A copy given back or expired unfinished: another volunteer gets the check, while it can.

    ``device_id``: the device giving it back, which must hold it (None: the site's own sweep).
    """
    state = hot_state()
    if device_id is not None:
        holder = _holder(marker) or _holder_on_record(lease_id)
        if holder is None or holder.device_id != device_id:
            return  # not this device's copy: nothing of another volunteer's is touched
        if state.client.hdel(state.lease_campaigns_key, str(lease_id)):
            _write_report(holder.answer(lease_id, reported_at=timezone.now(), verdict=Answer.Verdict.NONE))
            _requeue_or_abandon(holder.check_id, holder.volunteer_id, lease_id, f"a copy was not finished ({reason})")
        return
    state.client.hdel(state.lease_campaigns_key, str(lease_id))
    answer = _only(Answer.objects.filter(lease_id=lease_id, reported_at__isnull=True).select_related("case"))
    if answer is not None:
        Answer.objects.filter(pk=answer.pk).update(reported_at=timezone.now(), verdict=Answer.Verdict.NONE)
        _requeue_or_abandon(answer.case_id, answer.volunteer_id, lease_id, f"a copy was not finished ({reason})")


MAX_COPIES = 4  # copies issued for one check before it is given up


def _requeue_or_abandon(check_id: int, volunteer_id: int, lease_id: int, why: str) -> None:
    """Queue a check again after its copy ``lease_id`` (of ``volunteer_id``) came to nothing, unless it had
    its copies; counts that copy and its volunteer whether or not its answer row is written yet (the
    batched records)."""
    case = _only(Check.objects.filter(pk=check_id))
    if case is None:
        return
    others = case.answers.exclude(lease_id=lease_id)
    if case.state == Check.State.REFEREE:
        return  # decided without this copy
    if case.open and others.count() + 1 < MAX_COPIES:
        excluded = set(others.values_list("volunteer_id", flat=True)) | {volunteer_id}
        _enqueue(case, sorted(excluded))
    else:
        unanswered(case.pk, why)


def unanswered(check_id: int, why: str) -> None:
    """A check no copy will answer (none taken in time, its version gone, its copies failed): the referee rules
    on the original alone, or, over its bounds, the check ends with no verdict as it did before the referee."""
    to_referee(check_id, why)


def to_referee(check_id: int, why: str) -> None:
    """Send an open check to the referee (``referee.rule`` decides it with ``decide``)."""
    with transaction.atomic():
        case = _only(Check.objects.select_for_update().filter(pk=check_id))
        if case is None or case.state not in (Check.State.OPEN, Check.State.TIEBREAK):
            return
        case.state, case.detail, case.disputed_at = Check.State.REFEREE, why[:300], timezone.now()
        case.save(update_fields=["state", "detail", "disputed_at"])
        referee.call(case.pk)
    logger.info("check %s of lease %s goes to the referee: %s", case.pk, case.lease_id, why)


# ------------------------------------------------------------------ judging


def _figures(agreement: Agreement) -> str:
    return f"cosine {agreement.cosine:.3f}, norm ratio {agreement.norm_ratio:.3f}"


def judge(check_id: int) -> None:
    """Decide a check whose copy is in: passed if it agrees and comes from an unlike volunteer, else the referee's."""
    with transaction.atomic():
        case = _only(Check.objects.select_for_update().filter(pk=check_id))
        if case is None or case.state not in (Check.State.OPEN, Check.State.TIEBREAK):
            return  # closed, or with the referee already
        answers = list(case.answers.filter(verdict=Answer.Verdict.PENDING).exclude(sketch=[]).order_by("issued_at"))
        original = next((a for a in answers if a.role == Answer.Role.ORIGINAL), None)
        copy = next((a for a in answers if a.role != Answer.Role.ORIGINAL), None)
        if original is None or copy is None:
            return
        agreement = compare(original.sketch, copy.sketch)
        agrees = agreement.agrees()
        if not agrees or copy.similar:
            why = "the copy's volunteer is like the original's" if agrees else standing.DISAGREEMENT
            to_referee(check_id, f"{why} ({_figures(agreement)})")
            if not agrees:
                disputed = (original.volunteer_id, copy.volunteer_id)
                transaction.on_commit(lambda: standing.note_disputed(disputed))
            return
        for answer, other in sorted(((original, copy), (copy, original)), key=lambda pair: pair[0].volunteer_id):
            _mark(answer, Answer.Verdict.AGREED, other)
            _record(answer.volunteer_id, passed=True)
        case.answers.filter(verdict=Answer.Verdict.PENDING).update(verdict=Answer.Verdict.NONE)
        _close(case, Check.State.PASSED, _figures(agreement))
    logger.info("check %s of lease %s: passed (%s)", case.pk, case.lease_id, case.detail)


def decide(check_id: int, ruling: list[float]) -> None:
    """Judge each answer of a check against the referee's sketch of the lease (``referee.recompute``).

    An answer that agrees with it wins its ruling, one that does not loses it, whoever agreed with whom;
    the check passes if the original agrees.
    """
    failed_volunteers: list[int] = []
    with transaction.atomic():
        case = _only(Check.objects.select_for_update().filter(pk=check_id))
        if case is None or case.state != Check.State.REFEREE:
            return
        answers = list(case.answers.filter(verdict=Answer.Verdict.PENDING).exclude(sketch=[]).order_by("issued_at"))
        original = next((a for a in answers if a.role == Answer.Role.ORIGINAL), None)
        if original is None or any(len(a.sketch) != len(ruling) for a in answers):
            why = "no original answer" if original is None else "the campaign's slices changed since"
            case.answers.filter(verdict=Answer.Verdict.PENDING).update(verdict=Answer.Verdict.NONE)
            _close(case, Check.State.UNRULED, f"{case.detail}; the referee cannot judge it: {why}")
            return
        figures, upheld = [], False
        # Standing rows are locked in volunteer order: two rulings over the same two volunteers never deadlock.
        for answer in sorted(answers, key=lambda a: (a.volunteer_id, a.pk)):
            agreement = compare(answer.sketch, ruling)
            won = agreement.agrees()
            Answer.objects.filter(pk=answer.pk).update(
                verdict=Answer.Verdict.AGREED if won else Answer.Verdict.DISAGREED,
                cosine=agreement.cosine,
                norm_ratio=agreement.norm_ratio,
            )
            _record(answer.volunteer_id, passed=won, ruled=True)
            if not won:
                failed_volunteers.append(answer.volunteer_id)
            upheld = upheld or (won and answer is original)
            figures.append(f"{answer.role} {_figures(agreement)}")
        state = Check.State.PASSED if upheld else Check.State.FAILED
        _close(case, state, f"referee: {'; '.join(figures)} ({case.detail})")
    standing.reload_soon()  # who is held changed (``standing.held``)
    logger.info("check %s of lease %s: %s by the referee (%s)", case.pk, case.lease_id, state, "; ".join(figures))
    from .quarantine import consider

    for volunteer_id in sorted(set(failed_volunteers)):
        consider(volunteer_id)


def _mark(answer: Answer, verdict: str, against: Answer) -> None:
    """Store an answer's verdict with its figures against the answer it agreed with."""
    agreement = compare(answer.sketch, against.sketch)
    Answer.objects.filter(pk=answer.pk).update(
        verdict=verdict, cosine=agreement.cosine, norm_ratio=agreement.norm_ratio
    )


def _record(volunteer_id: int, *, passed: bool, ruled: bool = False) -> None:
    """Count a check for or against a volunteer; ``ruled``: the referee decided it."""
    row, _ = Standing.objects.select_for_update().get_or_create(volunteer_id=volunteer_id)
    if passed:
        row.checks_passed += 1
        row.streak += 1
        row.rulings_won += ruled
    else:
        row.checks_failed += 1
        row.streak = 0
        row.rulings_lost += ruled
    row.save(update_fields=["checks_passed", "checks_failed", "streak", "rulings_won", "rulings_lost"])
    # The new record, not a reload: a check changes no one's refusal (a quarantine, in ``quarantine``,
    # forgets those), and reading every refusal again after each check cost the lease path a query.
    record = standing.Record(row.checks_passed, row.streak)
    transaction.on_commit(lambda: standing.remember(volunteer_id, record))
    if passed and row.checks_passed == 1:
        # Their first verified result vouches for the leases whose checks ended undecided (``UNDECIDED``).
        transaction.on_commit(lambda: release_credit(volunteer_id=volunteer_id))


def settle(check_id: int, state: str, detail: str) -> None:
    """End a check without a verdict on anyone (abandoned, inconclusive): its lease's credit is released."""
    with transaction.atomic():
        case = _only(Check.objects.select_for_update().filter(pk=check_id))
        if case is None or not case.open:
            return
        case.answers.filter(verdict=Answer.Verdict.PENDING).update(verdict=Answer.Verdict.NONE)
        _close(case, state, detail)
    logger.info("check %s of lease %s: %s (%s)", case.pk, case.lease_id, state, detail)


def _close(case: Check, state: str, detail: str) -> None:
    case.state, case.detail, case.decided_at = state, detail[:300], timezone.now()
    case.save(update_fields=["state", "detail", "decided_at"])
    if state == Check.State.PASSED:  # vouched for by its own verdict: nothing to look up before the grant
        transaction.on_commit(lambda: _grant_checked(case))
    elif state != Check.State.FAILED:
        transaction.on_commit(lambda: release_credit([case.pk]))


# ------------------------------------------------------------------ credit

WITHHOLDING = (Check.State.OPEN, Check.State.TIEBREAK, Check.State.REFEREE, Check.State.FAILED, Check.State.UNRULED)
# Checks that ended deciding nothing (nobody copied it and the referee could not rule). Their lease is
# credited on its volunteer's record: once one of their checks has passed. A newcomer who is alone, or
# first, has every check abandoned, and would otherwise be paid for work nobody could vouch for.
UNDECIDED = (Check.State.ABANDONED, Check.State.INCONCLUSIVE)


def _unvouched() -> Q:
    """Checks that withhold their lease's credit: open or failed, or undecided for a volunteer never verified."""
    verified = Exists(Standing.objects.filter(volunteer_id=OuterRef("volunteer_id"), checks_passed__gt=0))
    return Q(state__in=WITHHOLDING) | Q(Q(state__in=UNDECIDED), ~verified)


def creditable(leases: list[LeaseRecord]) -> list[tuple[int, int, int]]:
    """``(lease id, device id, samples)`` of a committed step's lease records whose credit is due now.

    Left out: leases whose check is open or failed, or ended undecided for a volunteer with no check
    passed yet, and the work of quarantined volunteers.
    """
    held = withheld([r.id for r in leases])
    owners = standing.owners_of(r.device for r in leases)
    due = []
    for record in leases:
        if record.id not in held and not standing.refusal(owners.get(record.device)):
            due.append((record.id, record.device, record.samples))
    return due


def withheld(lease_ids: list[int]) -> set[int]:
    """The leases among these whose credit waits for, or was refused by, a check."""
    if not lease_ids:
        return set()
    return set(Check.objects.filter(_unvouched(), lease_id__in=lease_ids).values_list("lease_id", flat=True))


def release_credit(check_ids: list[int] | None = None, *, volunteer_id: int | None = None) -> int:
    """Grant the credit of checked leases that are committed and no longer withheld; returns how many.

    Called when a check ends, when a volunteer's first check passes (``volunteer_id``:
    their undecided ones), and by the periodic sweep for checks that ended before
    their step was committed.
    """
    cases = Check.objects.exclude(_unvouched()).filter(credited=False)
    if check_ids is not None:
        cases = cases.filter(pk__in=check_ids)
    if volunteer_id is not None:
        cases = cases.filter(volunteer_id=volunteer_id)
    return sum(_grant_checked(case) for case in cases)


def _grant_checked(case: Check) -> bool:
    """Grant the credit of one check's lease that nothing withholds any more, if it is committed.

    What the commit of its step left out while the check was open. A grant is
    written once per lease (the ledger ignores a second), so two processes
    releasing the same check at once credit it once.
    """
    if standing.refusal(case.volunteer_id):
        return False  # a quarantined volunteer's credit stays with the review
    lease = Lease.objects.filter(pk=case.lease_id, step__isnull=False).values_list("device_id", "num_samples").first()
    if lease is None:
        return False  # not committed yet: the commit grants it, or the sweep does
    config = campaign_config(case.campaign_id)
    if config is None:
        return False
    with transaction.atomic():
        ledger.grant(case.campaign_id, config.flops_per_sample, [(case.lease_id, lease[0], lease[1])])
        Check.objects.filter(pk=case.pk).update(credited=True)
    return True


def expire_copies() -> int:
    """Copies past their deadline: their checks go to another volunteer or are given up. Returns how many."""
    limit = timezone.now() - timedelta(seconds=settings.CROWDTRAIN_LEASE_MAX_DEADLINE_S + 60)
    late = list(
        Answer.objects.filter(reported_at__isnull=True, issued_at__lt=limit)
        .exclude(role=Answer.Role.ORIGINAL)
        .values_list("lease_id", flat=True)[:500]
    )
    for lease_id in late:
        copy_released(lease_id, "deadline passed")
    return len(late)


def clear_caches() -> None:
    """Forget which campaigns had no copies waiting, volunteers' tags, versions asked for (tests, whose ids
    come back)."""
    _empty_until.clear()
    affinity.clear_caches()
    referee.clear_caches()


def upkeep() -> None:
    """Once a minute on every site process: late copies, lost verdicts and rulings, credit of checks ended before
    commit, refused uploads whose lease rows were not written when they came, versions no check needs."""
    from .refusals import resolve

    resolve()
    expire_copies()
    judge_ripe()
    referee.waiting()
    release_credit()
    referee.prune()
