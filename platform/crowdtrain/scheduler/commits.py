"""Closing a full step: the database decides, then Redis opens the next step, then the aggregators hear of it.

The step row is the commit point. Its unique (campaign, index) lets exactly
one process write it however many notice the step is full; the others, and a
process that finds a step left full by one that crashed before telling Redis,
read the row back and carry on from there. The commit goes to the aggregators
after the row is durable, so an aggregator never applies a step the database
could forget; duplicates are harmless (an aggregator acknowledges a step it
already applied).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from django.db import IntegrityError, OperationalError, transaction
from django.db.models import Case, F, FloatField, Value, When

from crowdtrain.accounts.models import Device
from crowdtrain.campaigns.models import Campaign, Step
from crowdtrain.credit import ledger
from crowdtrain.ops.metrics import STEP_COMMIT_SECONDS
from crowdtrain.verification import checks
from crowdtrain_agent.protocol import StepCommit

from .configs import CampaignConfig
from .hotstate import HotStateMissing, hot_state
from .models import Lease, StepNetwork
from .network import step_totals
from .rebuild import load_campaign, to_shards

logger = logging.getLogger(__name__)

WRITE_ATTEMPTS = 3
SPEED_WEIGHT = 0.2  # of each step's measured rate in a device's moving-average speed (My devices)


@dataclass
class Commit:
    """A step the scheduler just closed, the aggregators that must apply it, and the waiting requests it wakes."""

    message: StepCommit
    aggregator_ids: list[int]
    woken: list[str] = field(default_factory=list)


def moment(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=UTC)


def held(record: dict[str, Any]) -> tuple[datetime, datetime, float]:
    """A reported lease's issue and report times, and its compute time capped by how long it was held.

    Capped again after rounding to the database's microseconds, so the stored
    compute time never exceeds the stored times' difference.
    """
    issued, finished = moment(float(record["t0"])), moment(float(record["t1"]))
    return issued, finished, min(float(record["cs"]), (finished - issued).total_seconds())


def _write_step(config: CampaignConfig, index: int, leases: list[dict[str, Any]]) -> list[int]:
    """The step row, its leases and their devices' credit in one transaction; returns the lease ids in the step.

    A transaction PostgreSQL aborts (a deadlock with another process's batch of
    lease records, which locks the same rows in another order) is run again: the
    write is idempotent, and the step must not wait for the sweep's takeover.
    """
    attempt = 1
    while True:
        try:
            return _write_step_once(config, index, leases)
        except OperationalError:
            if attempt >= WRITE_ATTEMPTS:
                raise
            logger.info(
                "campaign %s: writing step %s failed (try %s); trying again", config.id, index, attempt, exc_info=True
            )
            attempt += 1


def _write_step_once(config: CampaignConfig, index: int, leases: list[dict[str, Any]]) -> list[int]:
    try:
        with transaction.atomic():
            step = Step.objects.create(
                campaign_id=config.id,
                index=index,
                num_samples=sum(int(lease["n"]) for lease in leases),
                loss_sum=math.fsum(float(lease["loss"]) for lease in leases),
            )
            # What the step cost the volunteers' links (its leases' reports): one row, with the step.
            StepNetwork.objects.create(step=step, campaign_id=config.id, **step_totals(leases))
            rows = [_row(config, lease, step) for lease in leases]
            # Inserted when the batched record has not written them yet (another process issued them).
            Lease.objects.bulk_create(
                rows,
                update_conflicts=True,
                unique_fields=["id"],
                update_fields=["state", "step", "loss_sum", "compute_s", "finished_at", "reason"],
            )
            _credit(leases)
            # A lease picked for verification is credited when its check passes, not here (see verification).
            ledger.grant(config.id, config.flops_per_sample, checks.creditable(leases))
            Campaign.objects.filter(pk=config.id, committed_steps=index).update(committed_steps=index + 1)
            return [int(lease["id"]) for lease in leases]
    except IntegrityError:
        # Another process wrote this step first: it is what the aggregators must apply.
        step = Step.objects.get(campaign_id=config.id, index=index)
        logger.debug("campaign %s: step %s was committed by another process", config.id, index)
        return list(step.leases.order_by("id").values_list("id", flat=True))


def _row(config: CampaignConfig, record: dict[str, Any], step: Step) -> Lease:
    issued, finished, compute_s = held(record)
    ranges = to_shards(config.table, record["r"])
    return Lease(
        pk=record["id"],
        campaign_id=config.id,
        device_id=record["d"],
        base_version=record["b"],
        target_step=step.index,
        ranges=ranges,
        epoch=ranges[0][0],
        num_samples=record["n"],
        state=Lease.State.ACCEPTED,
        issued_at=issued,
        deadline=moment(record["dl"]),
        finished_at=finished,
        step=step,
        loss_sum=record["loss"],
        compute_s=compute_s,
    )


def _credit(leases: list[dict[str, Any]]) -> None:
    """One statement for every device in the step: samples credited, and the speed its work showed."""
    samples: dict[int, int] = {}
    busy_s: dict[int, float] = {}
    for lease in leases:
        samples[lease["d"]] = samples.get(lease["d"], 0) + int(lease["n"])
        busy_s[lease["d"]] = busy_s.get(lease["d"], 0.0) + float(lease["cs"])
    added = Case(*(When(pk=d, then=Value(n)) for d, n in samples.items()), default=Value(0))
    # The speed "My devices" shows: what its accepted work took, as the agent reported it, averaged.
    # One step's rate jumps with lease size, data fetches and whatever else the volunteer runs, so the
    # page shows an exponentially weighted moving average: new = (1 - w) * old + w * this step's rate,
    # computed in this same UPDATE from the stored value (no read first, so concurrent commits cannot
    # lose each other's measurement). The first measurement (stored 0) is taken as it is, not averaged
    # with a speed of 0.
    speeds: list[When] = []
    for d, s in busy_s.items():
        if s >= 1e-3:
            rate = samples[d] / s
            speeds.append(
                When(pk=d, samples_per_s__gt=0, then=F("samples_per_s") * (1 - SPEED_WEIGHT) + SPEED_WEIGHT * rate)
            )
            speeds.append(When(pk=d, then=Value(rate)))
    updates: dict[str, Any] = {"samples_accepted": F("samples_accepted") + added}
    if speeds:
        updates["samples_per_s"] = Case(*speeds, default=F("samples_per_s"), output_field=FloatField())
    Device.objects.filter(pk__in=sorted(samples)).update(**updates)


def commit_full_steps(config: CampaignConfig, full: dict[str, Any]) -> list[Commit]:
    """Commit the full open step, and every step after it that is full already (a lease reported ahead)."""
    commits: list[Commit] = []
    while full:
        index = int(full["step"])
        with STEP_COMMIT_SECONDS.time():
            lease_ids = _write_step(config, index, list(full["leases"]))
        num_samples = sum(int(lease["n"]) for lease in full["leases"])
        try:
            answer = hot_state().run("committed", config.hot_key, {"step": index})
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
        message = StepCommit(campaign_id=config.id, step=index, lease_ids=lease_ids, num_samples=num_samples)
        commits.append(Commit(message, list(config.aggregator_ids), [str(c) for c in answer.get("woken") or []]))
        full = answer.get("commit") or {}
    return commits
