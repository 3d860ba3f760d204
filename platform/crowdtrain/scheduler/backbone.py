"""The site's side of the backbone: which aggregator owns which slice, and which version is live.

Functions return ``(aggregator_id, message)`` pairs for ``crowdtrain.gateway``
to send, plus any VersionPublished to push to agents.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
from collections.abc import Sequence
from datetime import timedelta
from itertools import pairwise

import msgspec
from django.conf import settings
from django.db import transaction
from django.db.models import Case, Count, F, QuerySet, Value, When
from django.utils import timezone

from crowdtrain.accounts.models import Device
from crowdtrain.campaigns import validation
from crowdtrain.campaigns.keys import ticket_key
from crowdtrain.campaigns.models import Campaign, Step
from crowdtrain.campaigns.settings_table import aggregator_settings
from crowdtrain.datasets.models import shard_table
from crowdtrain_agent.models import get_model
from crowdtrain_agent.optimizers import OPTIMIZERS
from crowdtrain_agent.protocol import (
    BackboneHello,
    CheckpointComplete,
    CheckpointSaved,
    ModelSpec,
    OptimizerSpec,
    Rollback,
    SliceLost,
    SliceReady,
    StepApplied,
    StepCommit,
    StepFailed,
    VersionPublished,
)
from crowdtrain_agent.protocol import (
    SliceAssignment as AssignMessage,
)
from crowdtrain_agent.protocol.schema import from_dict

from . import seam
from .configs import publish_hold, publish_state
from .durability import complete_versions
from .hotstate import HotStateMissing, hot_state
from .lease_rows import to_global
from .models import Aggregator, Checkpoint, Lease, SliceAssignment
from .rebuild import merge
from .records import writer

logger = logging.getLogger(__name__)

Outbox = list[tuple[int, object]]


# How many complete versions the aggregators are told to keep (the newest is the restore target;
# an older one is an operator's choice when the newest turns out unreadable).
COMPLETE_KEPT = 2


def locked_campaigns() -> QuerySet[Campaign]:
    """Campaign rows locked for this transaction, FOR NO KEY UPDATE (none of these changes a key).

    Not FOR UPDATE: that lock also blocks the foreign-key checks of every
    transaction that inserts lease rows of the campaign meanwhile (the record
    writer, a step's commit), and the site's lease traffic would wait on the
    version bookkeeping.
    """
    return Campaign.objects.select_for_update(of=("self",), no_key=True)


def restore_target(campaign: Campaign, at_most: int | None = None) -> int | None:
    """The newest complete version at or below ``at_most`` (default: the committed steps), or None.

    Version 0, the seeded init, every slice can rebuild; it counts while no
    checkpoint has been due yet (going back to it loses fewer than
    ``checkpoint_every`` steps, the bound any crash may cost). Past that, None
    means a slice that lost its state cannot be replaced without an operator:
    the campaign is never silently reset to its initial weights.
    """
    limit = campaign.committed_steps if at_most is None else at_most
    complete = [v for v in complete_versions(campaign) if v <= limit]
    if complete:
        return complete[-1]
    if campaign.committed_steps == 0 or 0 < campaign.checkpoint_every and limit < campaign.checkpoint_every:
        return 0
    return None


_UNSET = -1


def _assign_message(s: SliceAssignment, campaign: Campaign, restore_version: int | None = _UNSET) -> AssignMessage:
    # The slice's own version: what a gracefully stopped aggregator checkpointed last, so it resumes
    # there without a rollback. Without that checkpoint it goes to the restore target instead
    # (``restore_version``: pass it when assigning every slice of a campaign, to look it up once).
    if restore_version == _UNSET:
        restore_version = restore_target(campaign)
    return AssignMessage(
        campaign_id=campaign.pk,
        slice_index=s.index,
        start=s.start,
        end=s.end,
        param_count=campaign.param_count,
        model=ModelSpec(
            architecture=campaign.architecture,
            config=get_model(campaign.architecture).compact(campaign.model_config),
        ),
        optimizer=from_dict(OptimizerSpec, campaign.optimizer),
        version=max(s.version, campaign.version),
        restore_version=restore_version,
        ticket_key=_assign_ticket_key(campaign.pk),
        timeline=campaign.timeline,
        initial=campaign.initial_weights or (campaign.pretrained.weights_sha256 if campaign.pretrained else ""),
        **aggregator_settings(campaign),
    )


def _assign_ticket_key(campaign_id: int) -> str:
    # A site pinned to 2.0 signs with the welcome's key and must leave the field at its default, or no
    # aggregator (all speak 2.0 to it) could be sent the assignment.
    return ticket_key(campaign_id).hex() if settings.CROWDTRAIN_PROTOCOL_MINOR >= 1 else ""


# Fused AdamW and SGD step a vector 16 elements at a time and round its last few elements in a scalar
# loop: cuts at multiples of 16 keep N aggregators' slices bit for bit equal to one aggregator holding
# the whole vector (other cuts differ in the last bits, 319 of 429 tried on a tiny GPT).
SLICE_ALIGN = 16


def slice_bounds(param_count: int, parts: int, tensor_sizes: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """Split ``param_count`` elements into ``parts`` contiguous, nearly equal slices, cut at multiples of 16.

    With ``tensor_sizes`` (the model's tensors in flat order), every cut falls
    where one tensor ends and the next begins, at the boundary nearest the
    even split: LAMB's trust ratio is per tensor, so a LAMB slice must hold
    whole tensors.

    Raises:
        ValueError: if the model has fewer tensors than ``parts``, or the sizes do not add up.
    """
    if tensor_sizes is None:
        edges = [0]
        for i in range(1, parts):
            aligned = round(param_count * i / parts / SLICE_ALIGN) * SLICE_ALIGN
            # Only a vector too short to cut at multiples of the alignment leaves them.
            edges.append(min(max(aligned, edges[-1] + 1), param_count - (parts - i)))
        edges.append(param_count)
        return list(pairwise(edges))
    if sum(tensor_sizes) != param_count:
        raise ValueError(f"tensor sizes add up to {sum(tensor_sizes)}, not the campaign's {param_count} parameters")
    if len(tensor_sizes) < parts:
        raise ValueError(
            f"the model has {len(tensor_sizes)} parameter tensors, too few for {parts} whole-tensor slices"
        )
    boundaries = [0, *itertools.accumulate(tensor_sizes)]
    chosen = [0]
    for i in range(1, parts):
        ideal = param_count * i // parts
        # Leave one boundary per slice still to cut, so no slice comes out empty.
        low, high = chosen[-1] + 1, len(boundaries) - 1 - (parts - i)
        j = min(max(bisect.bisect_left(boundaries, ideal), low), high)
        if j > low and ideal - boundaries[j - 1] <= boundaries[j] - ideal:
            j -= 1
        chosen.append(j)
    chosen.append(len(boundaries) - 1)
    edges = [boundaries[j] for j in chosen]
    return list(pairwise(edges))


def tensor_sizes(campaign: Campaign) -> list[int] | None:
    """The model's tensor sizes when the campaign's optimizer needs whole-tensor slices (LAMB), else None."""
    entry = OPTIMIZERS.get(campaign.optimizer.get("name"))
    if entry is None or not entry.per_tensor:
        return None
    shapes = get_model(campaign.architecture).param_shapes(campaign.model_config)
    return [math.prod(shape) for shape in shapes]


def live_aggregators() -> list[Aggregator]:
    # Connected is live: an aggregator's socket is its heartbeat (the site's pings close dead ones).
    return list(Aggregator.objects.filter(connected=True).annotate(load=Count("slices")).order_by("load", "id"))


def assign_waiting_campaigns() -> Outbox:
    """Give every running campaign without a full set of slices its aggregators, if enough are live."""
    outbox: Outbox = []
    # Called on every aggregator heartbeat: a cheap unlocked look first.
    waiting = list(
        Campaign.objects.filter(state=Campaign.State.RUNNING)
        .annotate(held=Count("slices"))
        .exclude(held=F("num_aggregators"))
        .values_list("id", flat=True)
    )
    if not waiting:
        return outbox
    with transaction.atomic():
        for campaign in locked_campaigns().filter(pk__in=waiting, state=Campaign.State.RUNNING):
            if campaign.slices.count() == campaign.num_aggregators:
                continue
            live = live_aggregators()
            if len(live) < campaign.num_aggregators:
                logger.debug(
                    "campaign %s waits for %s aggregators, %s live", campaign.pk, campaign.num_aggregators, len(live)
                )
                continue
            campaign.slices.all().delete()
            try:
                bounds = slice_bounds(campaign.param_count, campaign.num_aggregators, tensor_sizes(campaign))
            except ValueError as exc:
                logger.error("campaign %s cannot be split across its aggregators: %s", campaign.pk, exc)
                continue
            target = restore_target(campaign)
            # A whole-tensor split may make fewer slices than aggregators: the spare ones get none.
            for index, ((start, end), aggregator) in enumerate(zip(bounds, live, strict=False)):
                s = SliceAssignment.objects.create(
                    campaign=campaign,
                    aggregator=aggregator,
                    index=index,
                    start=start,
                    end=end,
                    version=campaign.version,
                )
                outbox.append((aggregator.pk, _assign_message(s, campaign, target)))
            publish_state(campaign.pk)
    return outbox


def aggregator_joined(aggregator_id: int, hello: BackboneHello, *, channel_name: str) -> Outbox:
    """Record a (re)connected aggregator and tell it which slices it owns.

    ``channel_name`` is the socket that speaks for the aggregator from now on;
    see ``aggregator_left``.
    """
    with transaction.atomic():
        Aggregator.objects.filter(pk=aggregator_id).update(
            upload_url=hello.upload_url,
            params_url=hello.params_url,
            connected=True,
            last_seen_at=timezone.now(),
            channel_name=channel_name,
        )
        outbox: Outbox = []
        held = SliceAssignment.objects.filter(aggregator_id=aggregator_id).exclude(
            campaign__state__in=[Campaign.State.FINISHED, Campaign.State.ARCHIVED]
        )
        for s in held.select_related("campaign"):
            s.ready = False
            s.save(update_fields=["ready"])
            outbox.append((aggregator_id, _assign_message(s, s.campaign)))
            publish_state(s.campaign_id)
    return outbox + assign_waiting_campaigns()


def aggregator_left(aggregator_id: int, *, channel_name: str) -> bool:
    """The aggregator's socket ``channel_name`` closed: if it was the current one, its slices stop being ready.

    That pauses leasing for their campaigns. The close of a socket that a
    newer one replaced changes nothing: after a reconnect the old socket may
    close last, and the campaign would otherwise stand still with every slice
    not ready while its aggregator is connected and working.

    Returns:
        Whether ``channel_name`` was the aggregator's current socket.
    """
    with transaction.atomic():
        # One conditional UPDATE: it holds the row until commit, so a newer socket's
        # aggregator_joined cannot land between this check and the slices' update.
        left = Aggregator.objects.filter(pk=aggregator_id, channel_name=channel_name).update(
            connected=False, channel_name="", last_seen_at=timezone.now()
        )
        campaign_ids: set[int] = set()
        if left:
            held = SliceAssignment.objects.filter(aggregator_id=aggregator_id)
            campaign_ids = set(held.values_list("campaign_id", flat=True))
            held.update(ready=False)
    for campaign_id in campaign_ids:
        publish_state(campaign_id)
    return bool(left)


def touch_aggregator(aggregator_id: int) -> None:
    """The database's "last seen" of an aggregator; its consumer calls this lazily, not on every heartbeat."""
    Aggregator.objects.filter(pk=aggregator_id).update(last_seen_at=timezone.now())


def _commits_since(campaign: Campaign, version: int) -> list[StepCommit]:
    return [
        StepCommit(
            campaign_id=campaign.pk,
            step=step.index,
            lease_ids=list(step.leases.order_by("id").values_list("id", flat=True)),
            num_samples=step.num_samples,
            timeline=campaign.timeline,
        )
        for step in campaign.steps.filter(index__gte=version).order_by("index")
    ]


def flush_records() -> None:
    """Write the queued lease records; called before a campaign's row is locked for a possible rollback.

    Never with that lock held: the writer thread may be waiting for the same
    row (a cursor update) inside its batch while holding the writer's own lock,
    and PostgreSQL cannot see a deadlock that is half a Python lock. That
    wait froze a campaign for good after an aggregator restart.
    """
    writer().flush()


def _rollback(campaign: Campaign, version: int) -> None:
    """Forget every step at or after ``version``; their samples and all in-flight work are redone.

    The devices' credit for the forgotten steps is taken back, so their totals
    stay equal to the committed work. Callers flush the lease records first
    (``flush_records``), before they lock the campaign. The campaign moves to a
    new timeline: a step whose write began before this and ends after it is
    discarded by its writer, and its commit, if one went out first, is dropped
    by the aggregators (``commits``; protocol 2.5).
    """
    committed_before = campaign.committed_steps
    table = shard_table(campaign.dataset)
    undone = Lease.objects.filter(campaign=campaign, step__index__gte=version)
    # Each sample once, even if two undone steps hold it (a counter repaired after a step was counted twice).
    spans: dict[int, list[tuple[int, int]]] = {}
    for lease in undone.only("ranges"):
        for epoch, start, count in to_global(table, lease.ranges):
            spans.setdefault(epoch, []).append((start, start + count))
    ranges = [[epoch, start, end - start] for epoch in sorted(spans) for start, end in merge(spans[epoch])]
    taken_back: dict[int, int] = {}
    for device_id, n in undone.values_list("device_id", "num_samples"):
        taken_back[device_id] = taken_back.get(device_id, 0) + n
    reason = f"rolled back to version {version}"
    now = timezone.now()
    seam.credit().reverse(undone.values_list("id", flat=True), reason, now)
    undone.update(step=None, state=Lease.State.REJECTED, reason=reason, finished_at=now)
    campaign.steps.filter(index__gte=version).delete()
    Checkpoint.objects.filter(campaign=campaign, version__gt=version).delete()  # a timeline that ended
    # Accepted-but-uncommitted gradients lived in the lost aggregator's memory.
    campaign.leases.filter(state__in=[Lease.State.ACCEPTED, Lease.State.ACTIVE], step__isnull=True).update(
        state=Lease.State.REJECTED, reason=reason, finished_at=now
    )
    if taken_back:
        back = Case(*(When(pk=d, then=Value(n)) for d, n in taken_back.items()), default=Value(0))
        Device.objects.filter(pk__in=sorted(taken_back)).update(samples_accepted=F("samples_accepted") - back)
    campaign.committed_steps = version
    campaign.version = min(campaign.version, version)
    campaign.timeline += 1
    campaign.save(update_fields=["committed_steps", "version", "timeline"])
    args = {"version": version, "ranges": ranges, "committed": committed_before, "line": campaign.timeline}
    try:
        hot_state().run("rollback", campaign.hot_key.hex, args)
    except HotStateMissing:
        pass  # loading it later reads the record written above
    publish_state(campaign.pk)
    logger.warning("campaign %s rolled back to version %s after an aggregator lost its state", campaign.pk, version)


def roll_back_everyone(campaign: Campaign, version: int, *, except_slice: SliceAssignment | None = None) -> Outbox:
    """Take the campaign back to ``version`` (complete, or the version every slice holds) once.

    Several paths notice one failure (a slice's ready report, its failed
    commit, the stuck-commit resend); the first rolls back and the others
    find the campaign there already and change nothing, so leases issued in
    between are not retired by a second rollback.
    """
    outbox: Outbox = []
    undoing = campaign.committed_steps > version or campaign.version > version
    if undoing:
        _rollback(campaign, version)
    for other in campaign.slices.all():
        if other.pk == getattr(except_slice, "pk", None):
            continue
        # A slice recorded at ``version`` may be applying the next step right now (its reply not in yet):
        # when steps are undone it goes back too; it costs nothing if it was still there.
        if other.version < version or other.version == version and not undoing:
            continue  # nothing newer to forget (or a rollback already on its way to it)
        other.ready = False
        other.version = min(other.version, version)
        other.save(update_fields=["ready", "version"])
        outbox.append(
            (other.aggregator_id, Rollback(campaign_id=campaign.pk, version=version, timeline=campaign.timeline))
        )
    return outbox


def block(campaign: Campaign, reason: str) -> None:
    campaign.blocked_reason = reason[:1000]
    campaign.save(update_fields=["blocked_reason"])
    publish_state(campaign.pk)
    logger.error("campaign %s is blocked: %s", campaign.pk, reason)


def _complete_text(campaign: Campaign) -> str:
    complete = complete_versions(campaign)
    return f"version {complete[-1]}" if complete else "none"


def slice_ready(aggregator_id: int, ready: SliceReady) -> Outbox:
    """An aggregator holds a slice at some version: resume it, replay commits, or roll everyone back."""
    outbox: Outbox = []
    flush_records()
    with transaction.atomic():
        campaign = locked_campaigns().filter(pk=ready.campaign_id).first()
        s = SliceAssignment.objects.filter(
            campaign_id=ready.campaign_id, index=ready.slice_index, aggregator_id=aggregator_id
        ).first()
        if campaign is None or s is None:
            logger.warning("aggregator %s reported a slice it does not own: %s", aggregator_id, ready)
            return outbox
        if ready.version < campaign.version:
            # It resumed from a complete version (the aggregator never offers another below ours).
            s.version = ready.version
            outbox += roll_back_everyone(campaign, ready.version, except_slice=s)
        s.ready = True
        s.version = ready.version
        s.save(update_fields=["ready", "version"])
        if campaign.blocked_reason:
            # It loaded a version the site vouched for: whatever blocked the campaign is behind it.
            campaign.blocked_reason = ""
            campaign.save(update_fields=["blocked_reason"])
        publish_state(ready.campaign_id)
        # Commits sent while it was away (or before a site restart) are sent again; it acks duplicates.
        outbox += [(aggregator_id, c) for c in _commits_since(campaign, ready.version)]
    return outbox


def slice_lost(aggregator_id: int, lost: SliceLost) -> None:
    """An aggregator has no usable state for a slice: the campaign waits for an operator, saying why."""
    with transaction.atomic():
        campaign = locked_campaigns().filter(pk=lost.campaign_id).first()
        s = (
            SliceAssignment.objects.filter(
                campaign_id=lost.campaign_id, index=lost.slice_index, aggregator_id=aggregator_id
            )
            .select_related("aggregator")
            .first()
        )
        if campaign is None or s is None:
            return
        s.ready = False
        s.save(update_fields=["ready"])
        block(
            campaign,
            f"aggregator {s.aggregator.name} lost slice {s.index} ({lost.detail}); newest complete "
            f"checkpoint: {_complete_text(campaign)}. Restore it from a complete checkpoint or restart "
            f"from scratch: `manage.py restore_campaign {campaign.pk}`, or the button on this page (staff)",
        )


def checkpoint_saved(aggregator_id: int, saved: CheckpointSaved) -> Outbox:
    """Record a slice's confirmed checkpoint; when that completes a version, tell the aggregators to keep it."""
    with transaction.atomic():
        campaign = Campaign.objects.filter(pk=saved.campaign_id).first()
        owns = SliceAssignment.objects.filter(
            campaign_id=saved.campaign_id, index=saved.slice_index, aggregator_id=aggregator_id
        ).exists()
        if campaign is None or not owns or saved.version > campaign.committed_steps:
            logger.warning("aggregator %s confirmed a checkpoint the site cannot use: %s", aggregator_id, saved)
            return []
        Checkpoint.objects.update_or_create(
            campaign=campaign,
            slice_index=saved.slice_index,
            version=saved.version,
            defaults={"aggregator_id": aggregator_id, "saved_at": timezone.now()},
        )
        complete = complete_versions(campaign)
        if saved.version not in complete:
            return []
        kept = complete[-COMPLETE_KEPT:]
        # Older confirmations stop mattering once the aggregators may prune them.
        Checkpoint.objects.filter(campaign=campaign, version__lt=kept[0]).delete()
        # A campaign held for its checkpoints may commit again: the next sweep commits its full step.
        publish_hold(campaign)
        message = CheckpointComplete(campaign_id=campaign.pk, versions=kept)
        return [(a, message) for a in sorted(set(campaign.slices.values_list("aggregator_id", flat=True)))]


def stalled_commits(aggregator_id: int) -> Outbox:
    """Commits this aggregator should have applied long ago: a message the channel layer lost.

    Called on its heartbeats. Duplicates are harmless (an aggregator acknowledges a
    step it already applied), so resending after GONE_AFTER_S is safe.
    """
    stale = timezone.now() - timedelta(seconds=settings.CROWDTRAIN_GONE_AFTER_S)
    outbox: Outbox = []
    held = SliceAssignment.objects.filter(
        aggregator_id=aggregator_id, ready=True, campaign__state=Campaign.State.RUNNING
    )
    for s in held.select_related("campaign"):
        overdue = s.campaign.steps.filter(index__gte=s.version, committed_at__lt=stale).exists()
        if overdue:
            logger.warning(
                "campaign %s: slice %s is stuck at version %s; sending its commits again",
                s.campaign_id,
                s.index,
                s.version,
            )
            outbox += [(aggregator_id, c) for c in _commits_since(s.campaign, s.version)]
    return outbox


def step_failed(aggregator_id: int, failed: StepFailed) -> Outbox:
    """A slice could not apply a commit: replay what it missed, redo the steps whose gradients it lost,
    or, when it holds them and still failed, pause the campaign and say why."""
    outbox: Outbox = []
    if failed.missing_lease_ids:
        flush_records()
    with transaction.atomic():
        campaign = locked_campaigns().filter(pk=failed.campaign_id).first()
        s = (
            SliceAssignment.objects.filter(
                campaign_id=failed.campaign_id, index=failed.slice_index, aggregator_id=aggregator_id
            )
            .select_related("aggregator")
            .first()
        )
        if campaign is None or s is None:
            return outbox
        if failed.missing_lease_ids:
            # Its pending uploads are gone (a restart from a checkpoint): every step from the one it is at
            # is redone from the samples up. Slices already past it go back too, which needs a version all
            # of them have: that one, if nobody is past it, else the newest complete checkpoint below it.
            others = campaign.slices.exclude(pk=s.pk)
            # Recorded at failed.step and ready counts too: it may have applied that step already, its
            # reply not in yet (a slice rolled back to a version it lacks would stand still for good).
            ahead = (
                others.filter(version__gt=failed.step).exists()
                or others.filter(version=failed.step, ready=True).exists()
            )
            target = restore_target(campaign, failed.step) if ahead else failed.step
            if target is None:
                block(
                    campaign,
                    f"slice {s.index} lost the uploads of step {failed.step}, other slices are past "
                    "it, and no checkpoint every slice has exists; restore the campaign from scratch",
                )
                return outbox
            outbox += roll_back_everyone(campaign, target, except_slice=s if target == failed.step else None)
        elif failed.step > s.version:
            # A commit overtook an earlier one (or one was lost): send everything from where it is.
            outbox += [(aggregator_id, c) for c in _commits_since(campaign, s.version)]
        elif failed.step == s.version:
            _could_not_apply(campaign, s, failed)
    return outbox


def _could_not_apply(campaign: Campaign, s: SliceAssignment, failed: StepFailed) -> None:
    """The slice holds the step's uploads and its optimizer step raised (``failed.detail`` says what).

    Sending the commit again would fail the same way, and the aggregator trusts that
    slice's memory no more: the slice stops being ready, which pauses the campaign's
    leases and the stuck-commit resends (``stalled_commits`` skips it), until the
    aggregator reports it ready again: after it reconnects, or after a restore.
    """
    s.ready = False
    s.save(update_fields=["ready"])
    detail = failed.detail[:400]
    block(
        campaign,
        f"aggregator {s.aggregator.name} could not apply step {failed.step} to slice {s.index} "
        f"({detail}); training is paused and the step is not sent to it again. Fix the cause (the "
        "aggregator's log has the traceback), then restart that aggregator, which reloads the slice "
        f"from its checkpoint, or restore the campaign: `manage.py restore_campaign {campaign.pk}`, "
        "or the button on this page (staff)",
    )


def step_applied(aggregator_id: int, applied: StepApplied) -> VersionPublished | None:
    """Record one slice's progress; when every slice has a version, publish it to agents."""
    with transaction.atomic():
        campaign = locked_campaigns().filter(pk=applied.campaign_id).first()
        s = SliceAssignment.objects.filter(
            campaign_id=applied.campaign_id, index=applied.slice_index, aggregator_id=aggregator_id
        ).first()
        if campaign is None or s is None:
            return None
        if applied.version > campaign.committed_steps:
            # A step the site has rolled back since: the rollback order on its way to the slice undoes it.
            logger.info("campaign %s slice %s applied step %s, rolled back since", campaign.pk, s.index, applied.step)
            return None
        if applied.version > s.version:
            s.version = applied.version
            s.save(update_fields=["version"])
        versions = list(campaign.slices.values_list("version", flat=True))
        newest = min(versions) if len(versions) == campaign.num_aggregators else campaign.version
        if newest <= campaign.version:
            return None
        previous, campaign.version = campaign.version, newest
        fields = ["version"]
        finished = campaign.max_steps is not None and newest >= campaign.max_steps
        if finished:
            campaign.state = Campaign.State.FINISHED
            fields += ["state", *campaign.stamp_state()]
        campaign.save(update_fields=fields)  # a finish reaches the lease path through the save signal
        # Steps committed before a finish by hand are applied after it: the version they make is the
        # model the campaign ends with, so it is validated and exported like a last step.
        ended = finished or campaign.state == Campaign.State.FINISHED
        if validation.due(campaign, previous, newest, ended):
            # After the commit, and off this consumer: the task fetches params and runs the model.
            validation.schedule_validation(campaign.pk, newest)
        Step.objects.filter(campaign=campaign, index__lt=newest, applied_at__isnull=True).update(
            applied_at=timezone.now()
        )
        step = campaign.steps.filter(index=newest - 1).first()
        logger.info("campaign %s: version %s published", campaign.pk, newest)
        return VersionPublished(campaign_id=campaign.pk, version=newest, loss=step.loss if step else None)


def oldest_aggregator_minor() -> int:
    """The oldest protocol minor an aggregator may speak here.

    Since 2.1 each campaign signs its tickets with its own key, sent with the slices
    (``assign.ticket_key``); a 2.0 aggregator cannot read it, so only a site pinned
    to 2.0 (``CROWDTRAIN_PROTOCOL_MINOR=0``) serves one.
    """
    return min(1, settings.CROWDTRAIN_PROTOCOL_MINOR)


def welcome_ticket_key() -> str:
    """The welcome's ``ticket_key``: the one key of a site pinned to 2.0; since 2.1 keys come with the slices."""
    return settings.CROWDTRAIN_TICKET_KEY.hex() if settings.CROWDTRAIN_PROTOCOL_MINOR < 1 else ""


def restore_campaign(campaign_id: int, version: int) -> Outbox:
    """An operator's choice for a blocked campaign: go back to complete ``version``, or 0 to start over.

    Every step from ``version`` on is forgotten (their samples are redone and
    the credit for them taken back), and every slice is assigned again with
    ``version`` as the version to load.

    Raises:
        ValueError: ``version`` is neither 0 nor a complete checkpoint; the message lists the choices.
    """
    flush_records()
    with transaction.atomic():
        campaign = locked_campaigns().get(pk=campaign_id)
        complete = complete_versions(campaign)
        if version != 0 and version not in complete:
            choices = ", ".join(str(v) for v in complete) or "none"
            raise ValueError(
                f"version {version} of campaign {campaign.pk} has no checkpoint of every slice; complete "
                f"versions: {choices}. Choose one of them, or 0 to restart from scratch"
            )
        if campaign.committed_steps > version or campaign.version > version:
            _rollback(campaign, version)
        campaign.blocked_reason = ""
        campaign.save(update_fields=["blocked_reason"])
        outbox: Outbox = []
        for s in campaign.slices.all():
            s.ready, s.version = False, version
            s.save(update_fields=["ready", "version"])
            message = msgspec.structs.replace(_assign_message(s, campaign, version), version=version)
            outbox.append((s.aggregator_id, message))
        publish_state(campaign.pk)
    logger.warning("campaign %s restored to version %s by an operator", campaign_id, version)
    return outbox
