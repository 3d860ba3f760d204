"""A lease request: which work a device gets, from which campaign, or why none and when to ask again.

Each decision is one script run by Redis on the campaign's hot state
(``scripts.run``), so its cost does not grow with the number of volunteers or
leases in flight and any number of site processes serve a campaign at once.
The database learns the outcome behind the hot path, in batches (``records``).
The rest of a lease's life has a module each, in the order it happens:
``parking`` (a refused request waits for room), ``reporting`` (the done
report, which may commit a step through ``commits``) and ``endings`` (a lease
given back, abandoned or past its deadline).

These functions are synchronous and safe to call from any thread; the
gateway runs them off the event loop. They return protocol messages;
``crowdtrain.gateway`` sends them.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, cast

from django.conf import settings

from crowdtrain.accounts.models import Device
from crowdtrain.campaigns.models import Campaign
from crowdtrain_agent.protocol import (
    Lease as LeaseMessage,
)
from crowdtrain_agent.protocol import (
    NoLease,
    NoLeaseReason,
    SampleRange,
    Ticket,
    sign_ticket,
)

from . import browser_tabs, ids, network, seam
from .configs import CampaignConfig, campaign_config, most_lease_samples, open_to, running_campaigns
from .hotrecords import lease_record
from .hotstate import hot_state
from .lease_rows import lease_row
from .models import Lease
from .records import writer
from .scripts import record_retired, run

# A quarantined volunteer's agent asks again this often: it resumes by itself once an admin clears them.
QUARANTINED_RETRY_S = 300.0

logger = logging.getLogger(__name__)

TICKET_GRACE_S = 30.0
# Expired leases the lease script retires per call; the rest wait for the next call or the sweep.
SWEEP_PER_CALL = 16


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


def forget_hardware(device_id: int) -> None:
    """The device's socket closed: what its hello said goes, so the cache holds connected devices only."""
    _hardware_flops.pop(device_id, None)


def lease_size(config: CampaignConfig, device_id: int, samples_per_s: float | None) -> tuple[int, float]:
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
    config: CampaignConfig,
    device_id: int,
    samples_per_s: float | None,
    request_id: str,
    backups: bool,
    owner: int | None,
    cap: int,
) -> LeaseMessage | NoLease:
    """New work; ``owner``: the device's volunteer, ``cap``: their probation cap (``standing.probation``)."""
    want, claimed = lease_size(config, device_id, samples_per_s)
    lease_id = ids.lease_ids.take()
    answer = run(
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
            "cap": cap,
            "relief_s": settings.CROWDTRAIN_PROBATION_RELIEF_S,
        },
    )
    record_retired(answer.get("expired") or [], config.id)
    if int(answer.get("gen") or 0) > config.gen:
        config = campaign_config(config.id, gen=int(answer["gen"])) or config
    if answer.get("kind") != "lease":
        ids.lease_ids.put_back(lease_id)
        return _refusal(config, answer)
    lease = lease_row(config, lease_record(answer["lease"]), request_id=request_id)
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
    """A waiting verification copy first (it must train on a version aggregators still serve), else new work.

    A volunteer on probation who is held (``standing.held``: a disputed or failed result) gets copies only.
    """
    if config.state == Campaign.State.RUNNING:
        copy = seam.verification().take_copy(config, device_id)
        if copy is not None:
            return copy
    standing = seam.standing()
    owner = standing.owner_of(device_id)
    cap = standing.probation(config.probation_cap, config.owner_id, owner)
    held = standing.held(owner) if cap else ""
    if held:
        return _no_lease("step_full", f"campaign {config.id}: {held}")
    return _try_lease(config, device_id, samples_per_s, request_id, backups, owner, cap)


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
    return lease_message(lease_row(config, record, request_id=request_id), config)


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
        not_for_tabs = browser_tabs.refusal(config, device_id)
        if not_for_tabs is not None:
            return LeaseAnswer(not_for_tabs, None)
        return LeaseAnswer(_copy_or_lease(config, device_id, samples_per_s, request_id, backups), campaign_id)
    refusals: list[tuple[NoLease, int]] = []
    for candidate_id in running_campaigns():
        config = campaign_config(candidate_id)
        if config is None or not open_to(config, device_id):
            continue
        not_for_tabs = browser_tabs.refusal(config, device_id)
        if not_for_tabs is not None:
            refusals.append((not_for_tabs, candidate_id))
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
