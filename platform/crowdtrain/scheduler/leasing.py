"""Leases and step accounting: the site's half of the life of a global step.

Each decision is one script run by Redis on the campaign's hot state
(``hotstate``), so its cost does not grow with the number of volunteers or
leases in flight and any number of site processes serve a campaign at once.
The database learns the outcome behind the hot path, in batches (``records``),
except for a step's commit, which is the database's to decide: the step row
is written first, then Redis opens the next step (``commits``).

These functions are synchronous and safe to call from any thread; the
gateway runs them off the event loop. They return protocol messages;
``crowdtrain.gateway`` sends them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

from django.conf import settings

from crowdtrain.accounts.models import Device
from crowdtrain.campaigns.models import Campaign, Step
from crowdtrain.datasets.models import shard_table
from crowdtrain.lib import metrics
from crowdtrain_agent.protocol import (
    DoneAck,
    LeaseDone,
    LeaseRequest,
    NoLease,
    NoLeaseReason,
    SampleRange,
    Ticket,
    sign_ticket,
    verify_receipt,
)
from crowdtrain_agent.protocol import (
    Lease as LeaseMessage,
)

from . import committer, ids, network, seam
from .commits import Commit, commit_full_steps, held, moment
from .configs import CampaignConfig, campaign_config, forget, most_lease_samples, open_to, running_campaigns
from .hotrecords import LeaseRecord, full_step, lease_record
from .hotstate import HotStateMissing, hot_state
from .models import Lease
from .rebuild import load_campaign, to_shards
from .records import Finished, writer

# A quarantined volunteer's agent asks again this often: it resumes by itself once an admin clears them.
QUARANTINED_RETRY_S = 300.0

logger = logging.getLogger(__name__)

TICKET_GRACE_S = 30.0
# A sample's mean loss above this is garbage, not training (ln 256 is 5.5); bounding it keeps a
# stranger's report from overflowing a step's loss sum.
MAX_LOSS_PER_SAMPLE = 1e6
# Expired leases the lease script retires per call; the rest wait for the next call or the sweep.
SWEEP_PER_CALL = 16


@dataclass
class DoneOutcome:
    ack: DoneAck
    commits: list[Commit] = field(default_factory=list)


# ------------------------------------------------------------------ helpers


def _run(config: CampaignConfig, script: str, args: dict[str, Any]) -> dict[str, Any]:
    """Run a script, loading the campaign's hot state from the record first if Redis has none."""
    try:
        return hot_state().run(script, config.hot_key, args)
    except HotStateMissing:
        load_campaign(config.id)
        # Read the campaign again: a copy cached before its row was replaced names another hot state.
        forget(config.id)
        fresh = campaign_config(config.id) or config
        return hot_state().run(script, fresh.hot_key, args)


def record_retired(retired: list[list[Any]], campaign_id: int | None = None) -> None:
    """Queue the record of leases a script ended (``[id, state, reason]`` triples), and count them.

    ``campaign_id``: the campaign they belong to, for the metrics and the log (None: counted without one).
    """
    if not retired:
        return
    when = moment(hot_state().clock())
    for lease_id, state, reason in retired:
        writer().lease_finished(Finished(int(lease_id), str(state), str(reason), when))
        metrics.lease_ended(campaign_id, str(state), str(reason))
        logger.info(
            "lease %s %s: %s", lease_id, state, reason, extra={"campaign_id": campaign_id, "lease_id": int(lease_id)}
        )


def _no_lease(
    reason: NoLeaseReason, detail: str, retry_after_s: float | None = None, ready_at_step: int | None = None
) -> NoLease:
    return NoLease(
        reason=reason,
        detail=detail,
        retry_after_s=retry_after_s or settings.CROWDTRAIN_RETRY_AFTER_S,
        ready_at_step=ready_at_step,
    )


_hardware_flops: dict[int, float] = {}


def note_hardware(device_id: int, flops_per_s: float) -> None:
    """What the agent's hello measured; the lease path sizes a device's first leases from it without a query."""
    _hardware_flops[device_id] = max(0.0, flops_per_s)


def _lease_size(config: CampaignConfig, device_id: int, samples_per_s: float | None) -> tuple[int, float]:
    """Samples for ~LEASE_TARGET_S of work on this device, and the speed that came from (0: unknown).

    A fast device gets a whole step, not a share of it: every lease costs the
    site a request, a report and the aggregators an upload, so fewer, larger
    leases per step are what keeps the overhead small next to compute. Devices
    still work side by side: staleness lets several steps be in flight, and an
    idle device is served before a busy one gets a lease ahead.
    """
    unit = config.lease_unit  # whole microbatches; whole inner batches in local mode
    speed = samples_per_s if samples_per_s is not None and math.isfinite(samples_per_s) and samples_per_s > 0 else 0.0
    if not speed:
        flops = _hardware_flops.get(device_id)
        if flops is None:
            hardware = Device.objects.filter(pk=device_id).values_list("hardware", flat=True).first() or {}
            flops = float(hardware.get("flops_per_s") or 0.0) if isinstance(hardware, dict) else 0.0
            note_hardware(device_id, flops)
        # The matmul benchmark overstates real training speed; halve it.
        speed = 0.5 * flops / config.flops_per_sample if flops > 0 and config.flops_per_sample > 0 else 0.0
    if not speed:
        return min(2 * unit, most_lease_samples(unit)), 0.0
    want = min(speed * settings.CROWDTRAIN_LEASE_TARGET_S, most_lease_samples(unit))
    return max(unit, int(want // unit) * unit), speed


# ------------------------------------------------------------------ leasing


def _refusal(config: CampaignConfig, answer: dict[str, Any]) -> NoLease:
    code = answer["code"]
    if code == "paused":
        finished = answer.get("state") in (Campaign.State.FINISHED, Campaign.State.ARCHIVED) or "finished" in str(
            answer.get("why")
        )
        if finished:
            return _no_lease("campaign_finished", f"campaign {config.id} has finished", 60.0)
        return _no_lease("campaign_paused", str(answer.get("why") or f"campaign {config.id} is paused"), 10.0)
    if code == "last_step":
        return _no_lease("step_full", f"campaign {config.id}: the last of its {answer['max']} steps is in flight")
    if code == "probation":
        return _no_lease(
            "step_full",
            f"campaign {config.id}: until checks of this volunteer's work pass, they hold at most "
            f"{answer['cap']} of a step's leases, and every step with room left has as many of theirs; "
            "waiting for the next commit",
            ready_at_step=int(answer["ready_at"]),
        )
    if code == "window_full":
        return _no_lease(
            "step_full",
            f"step {answer['step']} has all {config.target_batch_size} samples in flight; waiting for its commit",
            ready_at_step=int(answer["ready_at"]),
        )
    return _no_lease(
        "step_full",
        f"campaign {config.id}: idle volunteers are served before leases ahead",
        ready_at_step=int(answer["ready_at"]),
    )


def _try_lease(
    config: CampaignConfig, device_id: int, samples_per_s: float | None, request_id: str, backups: bool = True
) -> LeaseMessage | NoLease:
    want, claimed = _lease_size(config, device_id, samples_per_s)
    owner = seam.standing().owner_of(device_id)
    lease_id = ids.lease_ids.take()
    answer = _run(
        config,
        "lease",
        {
            "device": device_id,
            "want": want,
            "claimed": claimed,
            "id": lease_id,
            "cid": config.id,
            "min_dl": settings.CROWDTRAIN_LEASE_MIN_DEADLINE_S,
            "max_dl": settings.CROWDTRAIN_LEASE_MAX_DEADLINE_S,
            "idle_s": settings.CROWDTRAIN_GONE_AFTER_S,
            "gone_s": settings.CROWDTRAIN_GONE_AFTER_S,
            "backup_min_s": settings.CROWDTRAIN_BACKUP_MIN_S,
            "backup_factor": settings.CROWDTRAIN_BACKUP_FACTOR,
            "sweep": SWEEP_PER_CALL,
            "rid": request_id,
            "backups": int(backups),
            "owner": owner or 0,
            "cap": seam.standing().probation(config.probation_cap, config.owner_id, owner),
            "relief_s": settings.CROWDTRAIN_PROBATION_RELIEF_S,
        },
    )
    record_retired(answer.get("expired") or [], config.id)
    if int(answer.get("gen") or 0) > config.gen:
        config = campaign_config(config.id, gen=int(answer["gen"])) or config
    if answer.get("kind") != "lease":
        ids.lease_ids.put_back(lease_id)
        return _refusal(config, answer)
    lease = _row(config, lease_record(answer["lease"]), request_id)
    writer().lease_issued(lease)
    writer().cursor_moved(config.id, int(answer["epoch"]), int(answer["cursor"]))
    logger.debug(
        "lease %s issued to device %s: %s samples for step %s",
        lease.pk,
        device_id,
        lease.num_samples,
        lease.target_step,
        extra={"campaign_id": config.id, "lease_id": lease.pk, "device_id": device_id, "step": lease.target_step},
    )
    return lease_message(lease, config)


def _copy_or_lease(
    config: CampaignConfig, device_id: int, samples_per_s: float | None, request_id: str, backups: bool = True
) -> LeaseMessage | NoLease:
    """A waiting verification copy first (it must train on a version aggregators still serve), else new work."""
    if config.state == Campaign.State.RUNNING:
        copy = seam.verification().take_copy(config, device_id)
        if copy is not None:
            return copy
    return _try_lease(config, device_id, samples_per_s, request_id, backups)


def _row(config: CampaignConfig, record: LeaseRecord, request_id: str = "") -> Lease:
    ranges = to_shards(config.table, record.ranges)
    return Lease(
        pk=record.id,
        campaign_id=config.id,
        device_id=record.device,
        base_version=record.base_version,
        target_step=record.step,
        ranges=ranges,
        epoch=ranges[0][0] if ranges else 0,
        num_samples=record.samples,
        state=Lease.State.ACTIVE,
        issued_at=moment(record.issued_at),
        deadline=moment(record.deadline),
        request_id=request_id[:64],
    )


def lease_message(lease: Lease, config: CampaignConfig, *, check: bool = False) -> LeaseMessage:
    """The wire form of a lease, with a freshly signed ticket (also used to answer a repeated request).

    ``check``: the lease is a verification copy (``crowdtrain.verification``); its ticket says so.
    """
    seconds = max(0.0, lease.deadline.timestamp() - hot_state().clock())
    ticket = Ticket(
        lease_id=lease.pk,
        campaign_id=config.id,
        device_id=lease.device_id,
        base_version=lease.base_version,
        num_samples=lease.num_samples,
        expires_at=lease.deadline.timestamp() + TICKET_GRACE_S,
        check=check,
    )
    shards = config.table.sha256s
    return LeaseMessage(
        lease_id=lease.pk,
        campaign_id=config.id,
        base_version=lease.base_version,
        ranges=[SampleRange(shard=shards[s], start=start, count=count) for _, s, start, count in lease.ranges],
        num_samples=lease.num_samples,
        microbatch_size=config.microbatch_size,
        deadline_s=seconds,
        ticket=sign_ticket(ticket, config.ticket_key),
        codec=config.codec,
        codec_block_size=config.codec_block_size,
        mode=config.mode,
        inner=config.inner_for(lease.target_step),  # the schedule of the round the lease counts in
        inner_batch_size=config.inner_batch_size,
        # A local lease of the round after the one still being published: the agent rebases onto it.
        rebase_to=lease.target_step if config.mode == "local" and lease.target_step > lease.base_version else None,
        model=config.model,
        data=config.data,
        mixed_precision=config.mixed_precision,
        param_count=config.param_count,
        prefetch=_upcoming_shards(config, lease),
        slices=list(config.slices),
    )


MAX_PREFETCH_SHARDS = network.MAX_PREFETCH_SHARDS  # the next lease's shards, if it is as large as this one


def _upcoming_shards(config: CampaignConfig, lease: Lease) -> list[str]:
    """The shards the next lease of this size will read: from this lease's last shard on, enough to hold its samples.

    An agent fetches them while this lease computes, so its next lease seldom waits for data; a lease of
    many shards (a local-steps lease of hundreds of microbatches) names as many, at most ``MAX_PREFETCH_SHARDS``.
    """
    table = config.table
    if not table.sha256s or not lease.ranges:
        return []
    index, count = lease.ranges[-1][1], len(table.sha256s)
    upcoming: list[str] = []
    held = 0
    for k in range(min(MAX_PREFETCH_SHARDS, count)):
        shard = (index + k) % count
        upcoming.append(table.sha256s[shard])
        held += table.sizes[shard] if k else 0  # this lease's last shard is partly read already
        if k >= 1 and held >= lease.num_samples:
            break
    return list(dict.fromkeys(upcoming))


def _resent(device_id: int, request_id: str) -> LeaseMessage | None:
    """The lease an earlier copy of this request got, if it is still active."""
    state = hot_state()
    raw = cast("str | None", state.client.hget(state.requests_key, str(device_id)))  # decode_responses=True
    if not raw:
        return None
    campaign_id, lease_id, rid = raw.split(":", 2)
    if rid != request_id:
        return None
    config = campaign_config(int(campaign_id))
    if config is None:
        return None
    import json

    record_raw = state.client.hget(f"{state.campaign_key(config.hot_key)}leases", lease_id)
    record = lease_record(json.loads(record_raw)) if record_raw else None
    if record is None or record.state != "active" or record.device != device_id:
        return None
    return lease_message(_row(config, record, request_id), config)


@dataclass(frozen=True)
class LeaseAnswer:
    """The answer to a lease request, and the campaign it came from (where a refused request may wait)."""

    message: LeaseMessage | NoLease
    campaign_id: int | None


def ask_lease(
    device_id: int,
    campaign_id: int | None,
    samples_per_s: float | None,
    request_id: str = "",
    *,
    may_be_resent: bool = True,
    backups: bool = True,
) -> LeaseAnswer:
    """Give this device work from a running campaign, or say why not and when to ask again.

    A request repeated with the same ``request_id`` (the agent resends after a
    dropped connection) gets the lease the first one was given, not a second.
    An agent resends only on a new connection, so the gateway passes
    ``may_be_resent=False`` for later requests on one connection and saves the lookup.
    ``backups=False`` (a site process that is behind) gives no backup of a late lease.
    """
    refused = seam.standing().refusal(seam.standing().owner_of(device_id))
    if refused:
        return LeaseAnswer(_no_lease("quarantined", refused, QUARANTINED_RETRY_S), None)
    if request_id and may_be_resent:
        earlier = _resent(device_id, request_id)
        if earlier is not None:
            return LeaseAnswer(earlier, earlier.campaign_id)
    if campaign_id is not None:
        config = campaign_config(campaign_id)
        if config is None or not open_to(config, device_id):
            # One answer for "missing" and "not yours": strangers cannot tell which invite-only campaigns exist.
            return LeaseAnswer(
                _no_lease(
                    "no_campaign",
                    f"no campaign {campaign_id} is open to this device (an invite-only campaign needs "
                    "its invite link, opened while logged in as this device's volunteer)",
                    10.0,
                ),
                None,
            )
        if config.state == Campaign.State.DRAFT:
            return LeaseAnswer(_no_lease("campaign_paused", f"campaign {campaign_id} is draft", 10.0), None)
        return LeaseAnswer(_copy_or_lease(config, device_id, samples_per_s, request_id, backups), campaign_id)
    refusals: list[tuple[NoLease, int]] = []
    for candidate_id in running_campaigns():
        config = campaign_config(candidate_id)
        if config is None or not open_to(config, device_id):
            continue
        outcome = _copy_or_lease(config, device_id, samples_per_s, request_id, backups)
        if isinstance(outcome, LeaseMessage):
            return LeaseAnswer(outcome, candidate_id)
        refusals.append((outcome, candidate_id))
    if refusals:
        return LeaseAnswer(*min(refusals, key=lambda r: r[0].retry_after_s))
    return LeaseAnswer(_no_lease("no_campaign", "no running campaign accepts volunteers right now", 10.0), None)


def request_lease(
    device_id: int,
    campaign_id: int | None,
    samples_per_s: float | None,
    request_id: str = "",
    *,
    may_be_resent: bool = True,
) -> LeaseMessage | NoLease:
    """``ask_lease`` without the campaign: the answer the agent gets."""
    return ask_lease(device_id, campaign_id, samples_per_s, request_id, may_be_resent=may_be_resent).message


def park(
    campaign_id: int, device_id: int, samples_per_s: float | None, channel: str, ready_at: int, leave: str = ""
) -> str | None:
    """Queue a refused request to be woken by the commit that makes room; returns its place (None: room is there now).

    A commit wakes requests until the samples they would lease fill the step it
    freed, so it counts each by the lease it would get. ``leave`` takes an
    earlier place out of the queue in the same call.
    """
    config = campaign_config(campaign_id)
    if config is None:
        return None
    want = min(_lease_size(config, device_id, samples_per_s)[0], config.target_batch_size)
    owner = seam.standing().owner_of(device_id) or 0  # kept so a verification copy can call another volunteer
    answer = _run(config, "park", _park_args(channel=channel, ready_at=ready_at, want=want, owner=owner, leave=leave))
    return None if answer.get("ready") else str(answer.get("member") or "") or None


def _park_args(
    *, channel: str = "", ready_at: int = 0, want: int = 0, owner: int = 0, leave: str = "", skip: str = "",
    pass_on: int = 0,
) -> dict[str, Any]:  # fmt: skip
    return {
        "channel": channel, "ready_at": ready_at, "want": want, "owner": owner, "leave": leave, "skip": skip,
        "pass_on": pass_on,
    }  # fmt: skip


def unpark(campaign_id: int, member: str) -> None:
    config = campaign_config(campaign_id)
    if config is not None:
        _run(config, "park", _park_args(leave=member))


def pass_on_wake(campaign_id: int, *, any_step: bool = False) -> list[str]:
    """Who gets a turn that would otherwise go unused: the first waiting request.

    A woken socket had no request left to serve (it was answered
    meanwhile): the next request waiting for a step that is open now gets
    its place, so a commit's room is never left unused. With ``any_step``,
    a released lease put samples back into the open step: the first waiting
    request is woken whatever step it waits for.
    """
    config = campaign_config(campaign_id)
    if config is None:
        return []
    answer = _run(config, "park", _park_args(pass_on=2 if any_step else 1))
    return [str(c) for c in answer.get("woken") or []]


def wake_for_copy(campaign_id: int, skip_volunteers: Sequence[int]) -> list[str]:
    """Who is called to a verification copy that just queued: the first request waiting, of another volunteer.

    A copy needs no room in a step, so a request waiting for a commit can
    take it now. Left waiting, the copy is served only to the next request
    that comes in, and when one fast device takes every lease while the
    others wait, none comes: its base version leaves the aggregators'
    window, the check ends without a verdict, and that device's work is
    credited unchecked. At most one request is called per copy.
    """
    config = campaign_config(campaign_id)
    if config is None:
        return []
    answer = _run(config, "park", _park_args(pass_on=3, skip=",".join(str(v) for v in skip_volunteers)))
    return [str(c) for c in answer.get("woken") or []]


# ------------------------------------------------------------------ reports


def _lease_place(lease_id: int) -> tuple[CampaignConfig | None, str]:
    """The campaign of a lease, and its copy marker if it is a verification copy ("" if not)."""
    state = hot_state()
    campaign_id: str | int | None = cast("str | None", state.client.hget(state.lease_campaigns_key, str(lease_id)))
    if campaign_id is None:
        found = Lease.objects.filter(pk=lease_id).values_list("campaign_id", flat=True).first()
        if found is None:
            return None, ""
        campaign_id = found
    text = str(campaign_id)
    return campaign_config(int(text.split(":")[0])), text if seam.verification().is_copy_marker(text) else ""


def _receipt_problem(config: CampaignConfig, done: LeaseDone) -> str:
    if not 0.0 <= done.loss_sum <= MAX_LOSS_PER_SAMPLE * done.num_samples:
        return f"loss {done.loss_sum!r} is outside 0..{MAX_LOSS_PER_SAMPLE:g} per sample"
    tokens = {r.slice_index: r.token for r in done.receipts}
    for route in config.slices:
        token = tokens.get(route.index)
        valid = token is not None and verify_receipt(
            token,
            config.ticket_key,
            campaign_id=config.id,
            lease_id=done.lease_id,
            slice_index=route.index,
            num_samples=done.num_samples,
        )
        if not valid:
            return f"missing or invalid receipt for slice {route.index}"
    return ""


def report_done(device_id: int, done: LeaseDone) -> DoneOutcome:
    """Count a finished lease in its step if it is still valid; commit the step when full."""
    config, copy = _lease_place(done.lease_id)
    if config is None:  # another device's lease looks the same as no lease at all
        return DoneOutcome(DoneAck(lease_id=done.lease_id, accepted=False, reason="unknown lease"))
    refused = seam.standing().refusal(seam.standing().owner_of(device_id))
    if refused:
        release_leases(device_id, [done.lease_id], "volunteer quarantined")
        return DoneOutcome(DoneAck(lease_id=done.lease_id, accepted=False, reason=refused))
    if copy:
        problem = seam.verification().copy_done(config, device_id, done, _receipt_problem(config, done), copy)
        if problem:
            return DoneOutcome(DoneAck(lease_id=done.lease_id, accepted=False, reason=problem))
        return DoneOutcome(DoneAck(lease_id=done.lease_id, accepted=True, verification="check"))
    for _ in range(3):
        answer = _run(
            config,
            "done",
            {
                "id": done.lease_id,
                "device": device_id,
                "n": done.num_samples,
                "loss": done.loss_sum,
                "cs": done.compute_s if math.isfinite(done.compute_s) else 0.0,
                "problem": _receipt_problem(config, done),
                "gen": config.gen,
                **committer.handoff_args(config.id),
                **network.hot_args(network.bounded(config, done)),
            },
        )
        if "accepted" in answer:
            break
        config = campaign_config(config.id, gen=int(answer["gen"])) or config
    else:
        raise RuntimeError(
            f"campaign {config.id}: its generation keeps moving; the report of lease {done.lease_id} was not counted"
        )
    record_retired(answer.get("retired") or [], config.id)
    if not answer.get("accepted"):
        reason = str(answer.get("reason"))
        if reason == "unknown lease" and _counted(done.lease_id, device_id):
            reason = "lease already reported"  # a report sent again after its step committed (Redis forgot it)
        return DoneOutcome(DoneAck(lease_id=done.lease_id, accepted=False, reason=reason))
    lease = lease_record(answer["lease"])
    _, finished, compute_s = held(lease)
    writer().lease_finished(Finished(done.lease_id, Lease.State.ACCEPTED, "", finished, lease.loss, compute_s))
    metrics.lease_ended(config.id, Lease.State.ACCEPTED, "")
    step = int(answer["step"])
    logger.debug(
        "lease %s reported by device %s: %s samples counted in step %s",
        done.lease_id,
        device_id,
        done.num_samples,
        step,
        extra={"campaign_id": config.id, "lease_id": done.lease_id, "device_id": device_id, "step": step},
    )
    picked = seam.verification().maybe_pick(config, device_id, done, lease)
    ack = DoneAck(lease_id=done.lease_id, accepted=True, step=step, verification="pending" if picked else "")
    outcome = DoneOutcome(ack)
    full = full_step(answer["commit"]) if answer.get("commit") else None
    if full and full.queued:  # a committer writes it, tells the aggregators and wakes the waiting
        logger.debug("campaign %s: step %s is full and queued for a committer", config.id, full.step)
    elif full:
        outcome.commits = commit_full_steps(config, full)
    return outcome


def _counted(lease_id: int, device_id: int) -> bool:
    """Whether this device's lease is in a committed step (asked only for reports the hot state does not know)."""
    return Lease.objects.filter(pk=lease_id, device_id=device_id, step__isnull=False).exists()


def report_and_request(
    device_id: int, done: LeaseDone, waiting: LeaseRequest | None
) -> tuple[DoneOutcome, LeaseAnswer | None]:
    """Count a finished lease and, if that closed a step, answer the device's waiting lease request at once.

    The commit is what makes room for the reporting device's next lease (its
    previous one filled the step): asking here puts that lease on the wire
    right behind the ack.

    Returns:
        The report's outcome, and the answer to ``waiting`` (None when no step was committed).
    """
    outcome = report_done(device_id, done)
    if waiting is None or not outcome.commits:
        return outcome, None
    answer = ask_lease(device_id, waiting.campaign_id, waiting.samples_per_s, waiting.request_id, may_be_resent=False)
    return outcome, answer


@dataclass(frozen=True)
class Released:
    """Leases given back, and per campaign the waiting requests their samples can serve now."""

    count: int = 0
    woken: dict[int, list[str]] = field(default_factory=dict)


def release_leases(device_id: int, lease_ids: Sequence[int], reason: str = "released by the agent") -> Released:
    """Give unfinished leases back (the agent stops, or its socket closed for good); their samples are redone.

    Requests waiting for room are woken, one per lease released (the
    samples of one lease serve one request): otherwise they would sleep until
    the next commit, which waits for exactly these samples.
    """
    count = 0
    woken: dict[int, list[str]] = {}
    for lease_id in lease_ids:
        config, copy = _lease_place(lease_id)
        if config is None:
            continue
        if copy:
            seam.verification().copy_released(lease_id, reason, device_id=device_id, marker=copy)
            continue
        answer = _run(config, "release", {"id": lease_id, "device": device_id, "reason": reason, "state": "released"})
        retired = answer.get("retired") or []
        record_retired(retired, config.id)
        if retired:
            count += 1
            woken.setdefault(config.id, []).extend(pass_on_wake(config.id, any_step=True))
    return Released(count, woken)


def release_lease(device_id: int, lease_id: int, reason: str = "released by the agent") -> bool:
    """Give one unfinished lease back; whether it was still out (``release_leases`` also says whom to wake)."""
    return release_leases(device_id, [lease_id], reason).count > 0


def release_if_gone(device_id: int, lease_ids: list[int], since: float) -> Released:
    """Release a disconnected agent's leases unless it came back (seen after ``since``).

    Its socket closed, so waiting for the lease's deadline would only hold the
    step back; the short grace lets an agent whose connection merely dropped
    reconnect and report.
    """
    seen = hot_state().last_seen([device_id]).get(device_id, 0.0)
    if seen > since:
        return Released()
    return release_leases(device_id, lease_ids, "agent disconnected")


class Swept(NamedTuple):
    """What one sweep of a campaign did: leases expired, steps it closed, and whether a backup is due."""

    expired: int
    commits: list[Commit]
    backup_due: bool = False


def sweep_campaign(campaign_id: int) -> Swept:
    """Expire leases of gone agents past their deadline, and finish a commit a crashed process left open."""
    config = campaign_config(campaign_id)
    if config is None:
        return Swept(0, [])
    args = {"limit": 1000, "gone_s": settings.CROWDTRAIN_GONE_AFTER_S, "alive_since": committer.alive_since(),
            "backup_min_s": settings.CROWDTRAIN_BACKUP_MIN_S}  # fmt: skip
    answer = _run(config, "sweep", args)
    expired = answer.get("expired") or []
    record_retired(expired, config.id)
    commits = commit_full_steps(config, full_step(answer["commit"])) if answer.get("commit") else []
    return Swept(len(expired), commits, bool(answer.get("backup_due")))


def expire_overdue(campaign: Campaign) -> int:
    """Expire the campaign's leases past their deadline whose agents are gone; returns how many."""
    return sweep_campaign(campaign.pk).expired


def expire_all_overdue() -> tuple[int, list[Commit], dict[int, list[str]]]:
    """Periodic sweep of every running campaign (its cost grows with campaigns, not volunteers).

    Returns:
        (leases expired, steps closed, {campaign: waiting requests woken to take a backup that is due}).
    """
    count, commits, woken = 0, [], {}
    for campaign_id in running_campaigns():
        swept = sweep_campaign(campaign_id)
        count += swept.expired
        commits += swept.commits
        if swept.backup_due and (channels := pass_on_wake(campaign_id, any_step=True)):
            woken[campaign_id] = channels
    return count, commits, woken


def step_ranges(step: Step) -> list[tuple[str, int, int]]:
    """The (shard sha256, start, count) ranges that made a committed step, in lease-id order."""
    shards = shard_table(step.campaign.dataset).sha256s
    return [(shards[s], start, count) for lease in step.leases.order_by("id") for _, s, start, count in lease.ranges]
