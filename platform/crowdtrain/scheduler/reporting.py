"""A finished lease's report: checked, counted in its step, and the step committed when it fills.

The count is one script on the campaign's hot state; a report of a
verification copy goes to verification instead, through the seam.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from crowdtrain.lib import metrics
from crowdtrain_agent.protocol import DoneAck, LeaseDone, LeaseRequest, verify_receipt

from . import committer, leasing, network, seam
from .commits import Commit, commit_full_steps
from .configs import CampaignConfig, campaign_config
from .endings import release_leases
from .hotrecords import full_step, lease_record
from .lease_rows import held
from .models import Lease
from .records import Finished, writer
from .scripts import lease_place, record_retired, run

logger = logging.getLogger(__name__)


@dataclass
class DoneOutcome:
    ack: DoneAck
    commits: list[Commit] = field(default_factory=list)


# A sample's mean loss above this is garbage, not training (ln 256 is 5.5); bounding it keeps a
# stranger's report from overflowing a step's loss sum.
MAX_LOSS_PER_SAMPLE = 1e6


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
    config, copy = lease_place(done.lease_id)
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
        answer = run(
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
) -> tuple[DoneOutcome, leasing.LeaseAnswer | None]:
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
    answer = leasing.ask_lease(
        device_id, waiting.campaign_id, waiting.samples_per_s, waiting.request_id, may_be_resent=False
    )
    return outcome, answer
