"""Closing a full step: the database decides, then Redis opens the next step, then the aggregators hear of it.

The step row is the commit point. Its unique (campaign, index) lets exactly
one process write it however many notice the step is full; the others, and a
process that finds a step left full by one that crashed before telling Redis,
read the row back and carry on from there. The commit goes to the aggregators
after the row is durable, so an aggregator never applies a step the database
could forget; duplicates are harmless (an aggregator acknowledges a step it
already applied).

A rollback (``backbone._rollback``) and a step's write are ordered by the
campaign's row: the write's last statement moves ``committed_steps`` on only
from ``index`` and only on the timeline its leases were gathered on, so a
step being written when a rollback begins either commits before it (and the
rollback undoes it with the rest) or is discarded whole, its samples redone.
The step counter therefore always equals the number of step rows
(``scheduler.invariants`` checks it anyway).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from django.db import IntegrityError, OperationalError, transaction
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt

from crowdtrain.accounts.models import Device
from crowdtrain.campaigns.models import Campaign, Step
from crowdtrain.lib import batchsql
from crowdtrain.lib.metrics import STEP_COMMIT_SECONDS, STEPS_DISCARDED
from crowdtrain_agent.protocol import StepCommit

from . import seam
from .configs import CampaignConfig
from .hotrecords import FullStep, LeaseRecord, full_step
from .hotstate import HotStateMissing, hot_state
from .lease_rows import held, lease_row
from .models import Lease, StepNetwork
from .network import step_totals
from .rebuild import load_campaign

logger = logging.getLogger(__name__)

WRITE_ATTEMPTS = 3
SPEED_WEIGHT = 0.2  # of each step's measured rate in a device's moving-average speed (My devices)


class StepDiscarded(Exception):
    """The campaign was rolled back while this step was written: nothing of it may count."""


@dataclass
class Commit:
    """A step the scheduler just closed, the aggregators that must apply it, and the waiting requests it wakes."""

    message: StepCommit
    aggregator_ids: list[int]
    woken: list[str] = field(default_factory=list)
    delivered: bool = False  # the aggregators heard it already (from the committing thread)


def _write_step(config: CampaignConfig, index: int, leases: list[LeaseRecord], line: int) -> list[int]:
    """The step row, its leases and their devices' credit in one transaction; returns the lease ids in the step.

    ``line``: the campaign's timeline the leases were gathered on (the hot state's, when it handed them out).
    A transaction PostgreSQL aborts (a deadlock with another process's batch of
    lease records, which locks the same rows in another order, or with a rollback) is
    run again: the write is idempotent, and the step must not wait for the sweep's takeover.

    Raises:
        StepDiscarded: a rollback came first; the step must not be announced.
    """
    rewriting = Retrying(
        retry=retry_if_exception_type(OperationalError),
        stop=stop_after_attempt(WRITE_ATTEMPTS),
        before_sleep=lambda state: logger.info(
            "campaign %s: writing step %s failed (try %s); trying again",
            config.id,
            index,
            state.attempt_number,
            exc_info=state.outcome.exception() if state.outcome is not None else None,
        ),
        reraise=True,
    )
    return rewriting(_write_step_once, config, index, leases, line)


def _write_step_once(config: CampaignConfig, index: int, leases: list[LeaseRecord], line: int) -> list[int]:
    try:
        with transaction.atomic():
            step = Step.objects.create(
                campaign_id=config.id,
                index=index,
                num_samples=sum(lease.samples for lease in leases),
                loss_sum=math.fsum(lease.loss for lease in leases),
            )
            # What the step cost the volunteers' links (its leases' reports): one row, with the step.
            StepNetwork.objects.create(step=step, campaign_id=config.id, **step_totals(leases))
            _accept(config, leases, step)
            _credit(leases)
            # A lease picked for verification is credited when its check passes, not here (see verification).
            seam.credit().grant(config.id, config.flops_per_sample, seam.verification().creditable(leases))
            # The commit point, last: it locks the campaign's row, which a rollback holds while it undoes
            # steps (taken here after the lease and device rows, in the order the record writer takes them).
            # No match means a rollback came first: the whole write is undone with the exception.
            moved = Campaign.objects.filter(pk=config.id, committed_steps=index, timeline=line).update(
                committed_steps=index + 1
            )
            if not moved:
                raise StepDiscarded(_why_discarded(config.id, index, line))
            return [lease.id for lease in leases]
    except IntegrityError:
        # Another process wrote this step first: it is what the aggregators must apply, if it is of our timeline.
        step = Step.objects.get(campaign_id=config.id, index=index)
        if not Campaign.objects.filter(pk=config.id, timeline=line).exists():
            raise StepDiscarded(_why_discarded(config.id, index, line)) from None
        logger.debug("campaign %s: step %s was committed by another process", config.id, index)
        return list(step.leases.order_by("id").values_list("id", flat=True))


def _why_discarded(campaign_id: int, index: int, line: int) -> str:
    now = Campaign.objects.filter(pk=campaign_id).values_list("committed_steps", "timeline").first()
    steps, timeline = now if now is not None else (0, 0)
    return (
        f"campaign {campaign_id}: step {index} (timeline {line}) was not committed: the campaign is at step "
        f"{steps} of timeline {timeline} (a rollback came first); its samples are redone"
    )


def _accept(config: CampaignConfig, leases: list[LeaseRecord], step: Step) -> None:
    """Mark the step's leases accepted into it, with their outcomes.

    The batched record has almost always written the lease rows already (a site writes a lease's row within
    a quarter of a second of issuing it), so this is an update (``batchsql.accept_leases``). The few rows
    not written yet (another process issued them moments ago) are inserted whole.
    """
    if not leases:
        return
    # In id order, as the record writer writes them (opposite orders would deadlock).
    outcomes = sorted((lease.id, lease.loss, *held(lease)[1:]) for lease in leases)
    existing = batchsql.accept_leases(Lease, step.pk, outcomes, accepted_state=Lease.State.ACCEPTED)
    missing = sorted(
        (lease_row(config, lease, step=step) for lease in leases if lease.id not in existing), key=lambda row: row.pk
    )
    if missing:
        # Upserted: the other process's batch may write them between the read above and this insert.
        Lease.objects.bulk_create(
            missing,
            update_conflicts=True,
            unique_fields=["id"],
            update_fields=["state", "step", "loss_sum", "compute_s", "finished_at", "reason"],
        )


def _credit(leases: list[LeaseRecord]) -> None:
    """Every device in the step: samples credited, and the speed its work showed (``batchsql.count_device_work``)."""
    samples: dict[int, int] = {}
    busy_s: dict[int, float] = {}
    for lease in leases:
        samples[lease.device] = samples.get(lease.device, 0) + lease.samples
        busy_s[lease.device] = busy_s.get(lease.device, 0.0) + lease.compute_s
    # The speed "My devices" shows: what its accepted work took, as the agent reported it, averaged
    # (new = (1 - w) * old + w * this step's rate): one step's rate jumps with lease size, data fetches
    # and whatever else the volunteer runs. 0 where the step gave no rate: the speed stays as it is.
    work = {d: (samples[d], samples[d] / busy_s[d] if busy_s[d] >= 1e-3 else 0.0) for d in samples}
    batchsql.count_device_work(Device, work, SPEED_WEIGHT)


def commit_full_steps(config: CampaignConfig, first: FullStep) -> list[Commit]:
    """Commit the full open step, and every step after it that is full already (a lease reported ahead)."""
    commits: list[Commit] = []
    full: FullStep | None = first
    while full is not None:
        index, line = full.step, full.line
        try:
            with STEP_COMMIT_SECONDS.time():
                lease_ids = _write_step(config, index, full.leases, line)
        except StepDiscarded as exc:
            # The rollback gave these leases' samples back already (they were live in the hot state).
            logger.warning("%s", exc, extra={"campaign_id": config.id, "step": index})
            STEPS_DISCARDED.labels(campaign=str(config.id)).inc()
            break
        num_samples = sum(lease.samples for lease in full.leases)
        try:
            answer = hot_state().run("committed", config.hot_key, {"step": index, "line": line})
        except HotStateMissing:  # Redis lost the keys meanwhile: the record, step included, rebuilds them
            load_campaign(config.id)
            answer = {}
        logger.info(
            "campaign %s: step %s committed (%s samples, %s leases)",
            config.id,
            index,
            num_samples,
            len(lease_ids),
            extra={"campaign_id": config.id, "step": index},
        )
        message = StepCommit(
            campaign_id=config.id, step=index, lease_ids=lease_ids, num_samples=num_samples, timeline=line
        )
        commits.append(Commit(message, list(config.aggregator_ids), [str(c) for c in answer.get("woken") or []]))
        full = full_step(answer["commit"]) if answer.get("commit") else None
    return commits
