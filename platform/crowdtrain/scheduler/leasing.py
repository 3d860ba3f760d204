"""Leases and step accounting: the site's half of the life of a global step.

Every function runs in one transaction with the campaign row locked, so the
scheduler's decisions are serial per campaign whatever the number of agents.
They return the protocol messages to send; ``crowdtrain.gateway`` sends them.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Exists, F, Q, Sum
from django.utils import timezone

from crowdtrain.accounts.models import Device
from crowdtrain.campaigns.models import Campaign, ShardTable, Step, shard_table
from crowdtrain_agent.models import get_model
from crowdtrain_agent.protocol import (
    DataSpec,
    DoneAck,
    Lease as LeaseMessage,
    LeaseDone,
    LeaseRequest,
    ModelSpec,
    NoLease,
    SampleRange,
    SliceRoute,
    StepCommit,
    Ticket,
    sign_ticket,
    verify_receipt,
)

from .models import Lease, Participation, SliceAssignment
from .sampling import return_samples, take_samples

logger = logging.getLogger(__name__)

TICKET_GRACE_S = 30.0
# A sample's mean loss above this is garbage, not training (ln 256 is 5.5); bounding it keeps a
# stranger's report from overflowing a step's loss sum.
MAX_LOSS_PER_SAMPLE = 1e6


@dataclass
class Commit:
    """A step the scheduler just closed, and the aggregators that must apply it."""

    message: StepCommit
    aggregator_ids: list[int]


@dataclass
class DoneOutcome:
    ack: DoneAck
    commits: list[Commit] = field(default_factory=list)


def _locked(campaign_id: int) -> Campaign:
    # of=("self",): lock the campaign row only, not the dataset joined in (campaigns share datasets).
    return Campaign.objects.select_for_update(of=("self",)).select_related("dataset").get(pk=campaign_id)


def _sum(queryset: object) -> int:
    return queryset.aggregate(n=Sum("num_samples"))["n"] or 0  # type: ignore[attr-defined]


def retire_lease(lease: Lease, state: str, reason: str) -> None:
    """End a lease without counting it; its samples go back in the queue."""
    lease.state = state
    lease.reason = reason
    lease.finished_at = timezone.now()
    lease.save(update_fields=["state", "reason", "finished_at"])
    return_samples(lease.campaign_id, lease.ranges)
    logger.info("lease %s %s: %s", lease.pk, state, reason)


def expire_overdue(campaign: Campaign) -> int:
    """Expire leases past their deadline or held by agents silent for GONE_AFTER_S (or revoked)."""
    return _leases_in_flight(campaign).expired


def _no_lease(reason: str, detail: str, retry_after_s: float | None = None, ready_at_step: int | None = None) -> NoLease:
    return NoLease(reason=reason, detail=detail, retry_after_s=retry_after_s or settings.CROWDTRAIN_RETRY_AFTER_S,
                   ready_at_step=ready_at_step)  # fmt: skip


def _slices_ready(campaign: Campaign) -> tuple[list[SliceAssignment], str | None]:
    slices = list(campaign.slices.select_related("aggregator").order_by("index"))
    fresh = timezone.now() - timedelta(seconds=settings.CROWDTRAIN_GONE_AFTER_S)
    ready = [
        s for s in slices
        if s.ready and s.aggregator.connected and s.aggregator.last_seen_at and s.aggregator.last_seen_at >= fresh
    ]  # fmt: skip
    if len(slices) < campaign.num_aggregators or len(ready) < len(slices):
        return slices, f"waiting for aggregators: {len(ready)} of {campaign.num_aggregators} slices ready"
    return slices, None


def _note_request(campaign: Campaign, device_id: int) -> None:
    """Record that this device asked for work lately (``_others_idle`` reads it), refused or not."""
    now = timezone.now()
    if not Participation.objects.filter(campaign=campaign, device_id=device_id).update(last_request_at=now):
        Participation.objects.create(campaign=campaign, device_id=device_id, last_request_at=now)


def _others_idle(campaign: Campaign, device_id: int, holders: set[int]) -> bool:
    """Whether another live device that asked lately holds no lease while this one holds one."""
    if device_id not in holders:
        return False  # an idle device is served whatever the others do
    recent = timezone.now() - timedelta(seconds=settings.CROWDTRAIN_GONE_AFTER_S)
    return (
        campaign.participations.filter(last_request_at__gte=recent, device__last_seen_at__gte=recent)
        .exclude(device_id__in=holders)
        .exists()
    )


@dataclass
class LiveLeases:
    reserved: dict[int, int]  # samples reserved per step: active leases and accepted ones waiting for their step
    holders: set[int]  # devices holding an active lease
    expired: int  # leases expired on the way


def _leases_in_flight(campaign: Campaign) -> LiveLeases:
    """What the campaign's live leases reserve, expiring overdue ones on the way.

    One read of the active leases (and of accepted ones waiting for their
    step to fill) serves both the expiry and the count per step: this runs on
    every lease request.
    """
    now = timezone.now()
    gone = now - timedelta(seconds=settings.CROWDTRAIN_GONE_AFTER_S)
    rows = campaign.leases.filter(Q(state=Lease.State.ACTIVE) | Q(state=Lease.State.ACCEPTED, step__isnull=True))
    live = LiveLeases({}, set(), 0)
    overdue: list[int] = []
    for pk, step, holder, state, n, deadline, seen, revoked in rows.values_list(
        "pk", "target_step", "device_id", "state", "num_samples", "deadline", "device__last_seen_at",
        "device__revoked_at",
    ):  # fmt: skip
        if state == Lease.State.ACTIVE:
            if deadline < now or (seen is not None and seen < gone) or revoked is not None:
                overdue.append(pk)
                continue
            live.holders.add(holder)
        live.reserved[step] = live.reserved.get(step, 0) + n
    for lease in Lease.objects.filter(pk__in=overdue) if overdue else ():
        retire_lease(lease, Lease.State.EXPIRED, "deadline passed" if lease.deadline < now else "agent went silent")
        live.expired += 1
    return live


def _lease_size(campaign: Campaign, device_id: int, samples_per_s: float | None) -> tuple[int, float | None]:
    """Samples for ~LEASE_TARGET_S of work on this device, and its speed estimate.

    A fast device gets a whole step, not a share of it: every lease costs the
    site a request, a report and the aggregators an upload, so fewer, larger
    leases per step are what keeps the overhead small next to compute. Devices
    still work side by side: staleness lets several steps be in flight, and an
    idle device is served before a busy one gets a lease ahead (see
    ``_others_idle``).
    """
    micro = campaign.microbatch_size
    speed = samples_per_s if samples_per_s is not None and samples_per_s > 0 else None  # the agent's word
    if not speed:
        hardware = Device.objects.filter(pk=device_id).values_list("hardware", flat=True).first() or {}
        flops = float(hardware.get("flops_per_s") or 0.0)
        per_sample = get_model(campaign.architecture).flops_per_sample(campaign.model_config)
        # The matmul benchmark overstates real training speed; halve it.
        speed = 0.5 * flops / per_sample if flops > 0 else None
    if not speed:
        return 2 * micro, None
    want = speed * settings.CROWDTRAIN_LEASE_TARGET_S
    return max(micro, int(want // micro) * micro), speed


def _first_open_step(open_step: int, reserved: dict[int, int], target: int) -> int:
    """The first step whose global batch is not fully reserved yet."""
    step = open_step
    while reserved.get(step, 0) >= target:
        step += 1
    return step


def _try_lease(
    campaign: Campaign, device_id: int, samples_per_s: float | None, request_id: str = ""
) -> LeaseMessage | NoLease:
    # Cheapest refusals first: a pipelined agent asks while every step it may work on is full.
    live = _leases_in_flight(campaign)
    reserved, holders = live.reserved, live.holders
    _note_request(campaign, device_id)
    target = campaign.target_batch_size
    # Leases are computed on the newest committed version, which the aggregators may still be
    # applying: agents fetch it as soon as it is published instead of after a push and another request.
    base = campaign.open_step
    step = _first_open_step(base, reserved, target)
    if campaign.max_steps is not None and step >= campaign.max_steps:
        return _no_lease("step_full", f"campaign {campaign.pk}: the last of its {campaign.max_steps} steps is in flight")
    if step > base + campaign.staleness:
        return _no_lease(
            "step_full", f"step {base} has all {target} samples in flight; waiting for its commit",
            ready_at_step=step - campaign.staleness,
        )  # fmt: skip
    if _others_idle(campaign, device_id, holders):
        # This device asks ahead while another waits with nothing to do: the other goes first.
        return _no_lease("step_full", f"campaign {campaign.pk}: idle volunteers are served before leases ahead",
                         ready_at_step=base + 1)  # fmt: skip
    slices, waiting = _slices_ready(campaign)
    if waiting:
        return _no_lease("campaign_paused", f"campaign {campaign.pk}: {waiting}")
    size, speed = _lease_size(campaign, device_id, samples_per_s)
    size = min(size, target - reserved.get(step, 0), settings.CROWDTRAIN_MAX_LEASE_SAMPLES)
    ranges = take_samples(campaign, size)
    campaign.save(update_fields=["cursor", "epoch"])
    seconds = max(settings.CROWDTRAIN_LEASE_MIN_DEADLINE_S, 3 * size / speed if speed else 0.0)
    seconds = min(seconds, max(settings.CROWDTRAIN_LEASE_MAX_DEADLINE_S, settings.CROWDTRAIN_LEASE_MIN_DEADLINE_S))
    deadline = timezone.now() + timedelta(seconds=seconds)
    lease = Lease.objects.create(
        campaign=campaign, device_id=device_id, base_version=base, target_step=step, ranges=ranges,
        num_samples=size, deadline=deadline, request_id=request_id,
    )
    return lease_message(lease, campaign, slices)


def lease_message(lease: Lease, campaign: Campaign, slices: list[SliceAssignment]) -> LeaseMessage:
    """The wire form of a lease, with a freshly signed ticket (also used to answer a repeated request)."""
    seconds = max(0.0, (lease.deadline - timezone.now()).total_seconds())
    ticket = Ticket(
        lease_id=lease.pk, campaign_id=campaign.pk, device_id=lease.device_id, base_version=lease.base_version,
        num_samples=lease.num_samples, expires_at=lease.deadline.timestamp() + TICKET_GRACE_S,
    )
    table = shard_table(campaign.dataset)
    shards = table.sha256s
    return LeaseMessage(
        lease_id=lease.pk,
        campaign_id=campaign.pk,
        base_version=lease.base_version,
        ranges=[SampleRange(shard=shards[s], start=start, count=count) for _, s, start, count in lease.ranges],
        num_samples=lease.num_samples,
        microbatch_size=campaign.microbatch_size,
        deadline_s=seconds,
        ticket=sign_ticket(ticket, settings.CROWDTRAIN_TICKET_KEY),
        codec=campaign.codec,
        model=ModelSpec(architecture=campaign.architecture, config=campaign.model_config),
        data=DataSpec(kind=campaign.dataset.kind, sample_len=campaign.dataset.sample_len),
        param_count=campaign.param_count,
        prefetch=_upcoming_shards(campaign, table),
        slices=[
            SliceRoute(
                index=s.index, start=s.start, end=s.end, upload_url=s.aggregator.upload_url,
                params_url=f"{s.aggregator.params_url}{campaign.pk}/{s.index}/",
            )
            for s in slices
        ],
    )


def _upcoming_shards(campaign: Campaign, table: ShardTable) -> list[str]:
    """The shard at the campaign's cursor and the one after: where the next leases' samples come from."""
    if not table.sha256s:
        return []
    cursor = campaign.cursor if campaign.cursor < campaign.dataset.num_samples else 0  # past the end: a new epoch
    index = table.locate(cursor)
    upcoming = [table.sha256s[index], table.sha256s[(index + 1) % len(table.sha256s)]]
    return list(dict.fromkeys(upcoming))


def _open_q(device_id: int) -> Q:
    """Campaigns this device may work on: public ones, and invite-only ones its volunteer owns or was invited to."""
    staff = Exists(Device.objects.filter(pk=device_id, owner__is_staff=True))
    return (
        Q(visibility=Campaign.Visibility.PUBLIC) | Q(owner__devices=device_id) | Q(invited__devices=device_id) | Q(staff)
    )


def _open_to(campaign: Campaign, device_id: int) -> bool:
    # Public campaigns cost no query: the lease path stays as short as before for them.
    if campaign.visibility == Campaign.Visibility.PUBLIC:
        return True
    return Campaign.objects.filter(pk=campaign.pk).filter(_open_q(device_id)).exists()


def request_lease(
    device_id: int, campaign_id: int | None, samples_per_s: float | None, request_id: str = "",
    *, may_be_resent: bool = True,
) -> LeaseMessage | NoLease:
    """Give this device work from a running campaign, or say why not and when to ask again.

    A request repeated with the same ``request_id`` (the agent resends after a
    dropped connection) gets the lease the first one was given, not a second.
    An agent resends only on a new connection, so the gateway passes
    ``may_be_resent=False`` for later requests on one connection and saves the lookup.
    """
    with transaction.atomic():
        if request_id and may_be_resent:
            earlier = Lease.objects.filter(device_id=device_id, request_id=request_id, state=Lease.State.ACTIVE).first()
            if earlier is not None:
                campaign = _locked(earlier.campaign_id)
                slices = list(campaign.slices.select_related("aggregator").order_by("index"))
                return lease_message(earlier, campaign, slices)
        if campaign_id is not None:
            campaign = (
                Campaign.objects.select_for_update(of=("self",)).select_related("dataset").filter(pk=campaign_id).first()
            )
            if campaign is None or not _open_to(campaign, device_id):
                # One answer for "missing" and "not yours": strangers cannot tell which invite-only campaigns exist.
                return _no_lease(
                    "no_campaign", f"no campaign {campaign_id} is open to this device (an invite-only campaign needs "
                    "its invite link, opened while logged in as this device's volunteer)", 10.0,
                )  # fmt: skip
            if campaign.state == Campaign.State.RUNNING:
                return _try_lease(campaign, device_id, samples_per_s, request_id)
            if campaign.state in (Campaign.State.FINISHED, Campaign.State.ARCHIVED):
                return _no_lease("campaign_finished", f"campaign {campaign_id} has finished", 60.0)
            return _no_lease("campaign_paused", f"campaign {campaign_id} is {campaign.state}", 10.0)
        refusals: list[NoLease] = []
        running = (
            Campaign.objects.filter(state=Campaign.State.RUNNING).filter(_open_q(device_id))
            .distinct().order_by("id").values_list("id", flat=True)
        )
        for candidate_id in running:
            outcome = _try_lease(_locked(candidate_id), device_id, samples_per_s, request_id)
            if isinstance(outcome, LeaseMessage):
                return outcome
            refusals.append(outcome)
        if refusals:
            return min(refusals, key=lambda r: r.retry_after_s)
    return _no_lease("no_campaign", "no running campaign accepts volunteers right now", 10.0)


def _reject(lease: Lease, reason: str) -> DoneOutcome:
    retire_lease(lease, Lease.State.REJECTED, reason)
    return DoneOutcome(DoneAck(lease_id=lease.pk, accepted=False, reason=reason))


def _receipts_valid(lease: Lease, done: LeaseDone, slice_indexes: list[int]) -> str | None:
    tokens = {r.slice_index: r.token for r in done.receipts}
    for index in slice_indexes:
        token = tokens.get(index)
        valid = token is not None and verify_receipt(
            token, settings.CROWDTRAIN_TICKET_KEY, campaign_id=lease.campaign_id, lease_id=lease.pk,
            slice_index=index, num_samples=lease.num_samples,
        )
        if not valid:
            return f"missing or invalid receipt for slice {index}"
    return None


def _waiting_by_step(campaign: Campaign) -> dict[int, list[Lease]]:
    """Accepted leases not yet in a committed step, per reserved step, each list in lease-id order."""
    waiting: dict[int, list[Lease]] = {}
    leases = campaign.leases.filter(state=Lease.State.ACCEPTED, step__isnull=True, target_step__gte=campaign.open_step)
    for lease in leases.order_by("target_step", "id"):
        waiting.setdefault(lease.target_step, []).append(lease)
    return waiting


def commit_open_step(campaign: Campaign, leases: list[Lease], aggregator_ids: list[int]) -> Commit:
    """Close the open step over ``leases``, the accepted leases reserved in it, in lease-id order."""
    step = Step.objects.create(
        campaign=campaign, index=campaign.open_step, num_samples=sum(l.num_samples for l in leases),
        loss_sum=math.fsum(l.loss_sum or 0.0 for l in leases),
    )
    Lease.objects.filter(pk__in=[l.pk for l in leases]).update(step=step)
    credit: dict[int, int] = {}
    busy_s: dict[int, float] = {}
    for lease in leases:  # credit only work that made it into a committed step
        credit[lease.device_id] = credit.get(lease.device_id, 0) + lease.num_samples
        busy_s[lease.device_id] = busy_s.get(lease.device_id, 0.0) + (lease.compute_s or 0.0)
    for device_id in sorted(credit):  # in id order, so two commits never wait on each other's rows
        # The speed "My devices" shows: what its accepted work took, as the agent reported it.
        speed = {"samples_per_s": credit[device_id] / busy_s[device_id]} if busy_s[device_id] >= 1e-3 else {}
        Device.objects.filter(pk=device_id).update(samples_accepted=F("samples_accepted") + credit[device_id], **speed)
    campaign.committed_steps += 1
    campaign.save(update_fields=["committed_steps"])
    logger.info("campaign %s: step %s committed (%s samples, %s leases)", campaign.pk, step.index, step.num_samples, len(leases))
    message = StepCommit(
        campaign_id=campaign.pk, step=step.index, lease_ids=[l.pk for l in leases], num_samples=step.num_samples
    )
    return Commit(message, aggregator_ids)


def report_done(device_id: int, done: LeaseDone) -> DoneOutcome:
    """Count a finished lease in the open step if it is still valid; commit the step when full."""
    with transaction.atomic():
        owned = Lease.objects.filter(pk=done.lease_id, device_id=device_id).values_list("campaign_id", flat=True)
        campaign_id = owned.first()
        if campaign_id is None:  # another device's lease looks the same as no lease at all
            return DoneOutcome(DoneAck(lease_id=done.lease_id, accepted=False, reason="unknown lease"))
        campaign = _locked(campaign_id)
        lease = Lease.objects.get(pk=done.lease_id)  # read under the campaign's lock
        if lease.state != Lease.State.ACTIVE:
            already = "lease already reported" if lease.state == Lease.State.ACCEPTED else f"lease {lease.state}"
            return DoneOutcome(DoneAck(lease_id=lease.pk, accepted=False, reason=already))
        if lease.deadline < timezone.now():
            retire_lease(lease, Lease.State.EXPIRED, "deadline passed")
            return DoneOutcome(DoneAck(lease_id=lease.pk, accepted=False, reason="lease expired"))
        if done.num_samples != lease.num_samples:
            return _reject(lease, f"lease has {lease.num_samples} samples, report says {done.num_samples}")
        if not 0.0 <= done.loss_sum <= MAX_LOSS_PER_SAMPLE * done.num_samples:
            return _reject(lease, f"loss {done.loss_sum!r} is outside 0..{MAX_LOSS_PER_SAMPLE:g} per sample")
        slices = list(campaign.slices.order_by("index").values_list("index", "aggregator_id"))
        problem = _receipts_valid(lease, done, [index for index, _ in slices])
        if problem:
            return _reject(lease, problem)
        if lease.target_step < campaign.open_step or lease.base_version + campaign.staleness < lease.target_step:
            return _reject(lease, f"stale version: computed on {lease.base_version}, step {campaign.open_step} is open")
        lease.state = Lease.State.ACCEPTED
        lease.loss_sum = done.loss_sum
        lease.finished_at = timezone.now()
        # The agent's figure, kept within what is possible: it cannot have computed longer than it held the lease.
        held_s = max((lease.finished_at - lease.issued_at).total_seconds(), 0.0)
        lease.compute_s = min(max(done.compute_s, 0.0), held_s)
        lease.save(update_fields=["state", "loss_sum", "compute_s", "finished_at"])
        outcome = DoneOutcome(DoneAck(lease_id=lease.pk, accepted=True, step=lease.target_step))
        # A lease reported ahead of its step may complete several steps at once when the last one comes in.
        waiting = _waiting_by_step(campaign)
        aggregator_ids = [aggregator_id for _, aggregator_id in slices]
        while sum(l.num_samples for l in waiting.get(campaign.open_step, [])) >= campaign.target_batch_size:
            outcome.commits.append(commit_open_step(campaign, waiting.pop(campaign.open_step), aggregator_ids))
        return outcome


def report_and_request(
    device_id: int, done: LeaseDone, waiting: LeaseRequest | None
) -> tuple[DoneOutcome, LeaseMessage | NoLease | None]:
    """Count a finished lease and, if that closed a step, answer the device's waiting lease request at once.

    The commit is what makes room for the reporting device's next lease (its
    previous one filled the step): asking here puts that lease on the wire
    right behind the ack, ahead of the rest of the work the commit causes
    (aggregators' acknowledgements, other devices' waiting requests), all of
    which queue for the same database thread.

    Returns:
        The report's outcome, and the answer to ``waiting`` (None when no step was committed).
    """
    outcome = report_done(device_id, done)
    if waiting is None or not outcome.commits:
        return outcome, None
    answer = request_lease(device_id, waiting.campaign_id, waiting.samples_per_s, waiting.request_id, may_be_resent=False)
    return outcome, answer


def release_lease(device_id: int, lease_id: int) -> bool:
    """Give an unfinished lease back (the agent is shutting down); its samples are redone."""
    with transaction.atomic():
        lease = Lease.objects.filter(pk=lease_id, device_id=device_id).first()
        if lease is None:
            return False
        _locked(lease.campaign_id)
        lease.refresh_from_db()
        if lease.state != Lease.State.ACTIVE:
            return False
        retire_lease(lease, Lease.State.RELEASED, "released by the agent")
        return True


def expire_all_overdue() -> int:
    """Periodic sweep for campaigns nobody is asking leases of right now."""
    count = 0
    for campaign_id in Campaign.objects.filter(state=Campaign.State.RUNNING).values_list("id", flat=True):
        with transaction.atomic():
            count += expire_overdue(_locked(campaign_id))
    return count


def touch_device(device_id: int) -> None:
    Device.objects.filter(pk=device_id).update(last_seen_at=timezone.now())


def step_ranges(step: Step) -> list[tuple[str, int, int]]:
    """The (shard sha256, start, count) ranges that made a committed step, in lease-id order."""
    shards = shard_table(step.campaign.dataset).sha256s
    return [(shards[s], start, count) for lease in step.leases.order_by("id") for _, s, start, count in lease.ranges]
