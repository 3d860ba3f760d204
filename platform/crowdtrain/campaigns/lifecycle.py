"""A campaign's life: draft -> running <-> paused -> finished -> archived, and what each move does.

Pausing only changes the state: the scheduler leases work from running
campaigns alone, and leases already out are counted when they come back
before their deadlines (later ones expire), so the current ones drain. Starting makes the campaign wait for its
aggregators; ``assign_waiting_campaigns`` (also run on every aggregator
heartbeat) gives it slices as soon as enough are live.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from django.db import transaction

from crowdtrain.datasets.models import Dataset

from .browser_checks import check_for_browsers
from .models import Campaign
from .settings_table import SETTINGS, check_settings, locked_fields
from .setup import (
    CampaignConfigError,
    initial_weights_inputs,
    initial_weights_sha,
    prepare_initial_weights,
    validate_campaign,
)
from .signals import campaign_running
from .validation import schedule_validation

logger = logging.getLogger(__name__)

State = Campaign.State


class LifecycleError(ValueError):
    """A move the campaign cannot make from where it is; the message says why and what to do."""


@dataclass(frozen=True)
class Move:
    label: str  # the button
    sources: frozenset[str]
    target: str
    done: str  # the message after it succeeded
    # Moves that cannot be undone ask first: what happens, in a sentence, on the confirmation page.
    confirm: str = ""


MOVES: dict[str, Move] = {
    "start": Move(
        "Start", frozenset({State.DRAFT}), State.RUNNING, "started: it trains as soon as its aggregators are ready"
    ),
    "pause": Move(
        "Pause",
        frozenset({State.RUNNING}),
        State.PAUSED,
        "paused: no new leases; leases already out count if reported before their deadlines",
    ),
    "resume": Move("Resume", frozenset({State.PAUSED}), State.RUNNING, "resumed"),
    "finish": Move(
        "Finish",
        frozenset({State.RUNNING, State.PAUSED}),
        State.FINISHED,
        "finished",
        confirm=(
            "Training stops for good: volunteers get no more leases, leases still out are not counted, and a "
            "finished campaign cannot be resumed. Its last version is validated and offered for download."
        ),
    ),
    "archive": Move(
        "Archive",
        frozenset({State.DRAFT, State.FINISHED}),
        State.ARCHIVED,
        "archived",
        confirm="It leaves the campaign lists for good; its exports stay downloadable from this page.",
    ),
}

# What agents and aggregators built the model from: changing any of it after the start
# would make new gradients disagree with the parameters and optimizer state already held.
LOCKED_FIELDS = locked_fields()
LOCK_REASON = (
    "Locked since the campaign started: the aggregators hold parameters and optimizer state built from these "
    "settings and the agents compute with them, so changing one would break the model. "
    "Create a new campaign to train with other settings."
)


def config_locked(campaign: Campaign) -> bool:
    return campaign.state != State.DRAFT


def available_moves(campaign: Campaign) -> list[tuple[str, Move]]:
    return [(name, move) for name, move in MOVES.items() if campaign.state in move.sources]


def _check_trainable(campaign: Campaign) -> None:
    # The form validated it, but the admin and code can save any JSON: check once more before agents see it.
    try:
        check_settings({name: getattr(campaign, name) for name in SETTINGS}, error=CampaignConfigError)
        # The local mode's settings and the rules between settings are left at their defaults here, as
        # they always were at the start: the form and the admin checked them when they were saved.
        checked = ("target_batch_size", "microbatch_size", "codec", "max_steps", "num_aggregators", "augmentation")
        validate_campaign(
            {
                name: getattr(campaign, name)
                for name in ("dataset", "architecture", "model_config", "optimizer", "pretrained", *checked)
            }
        )
    except CampaignConfigError as exc:
        raise LifecycleError(f"the campaign cannot train as configured: {exc}; fix it in Edit") from None


def _check_dataset_ready(campaign: Campaign) -> None:
    if campaign.dataset.status != Dataset.Status.READY:
        raise LifecycleError(
            f"dataset “{campaign.dataset}” is not ready yet ({campaign.dataset.status}); "
            "start the campaign once it has been split into shards"
        )


def _prepare_weights(campaign_id: int) -> tuple[tuple[object, ...], str | None] | None:
    """A draft on pretrained weights: version 0's sha256, with what it was computed from; else None.

    Before the campaign's row is locked: reading the weights (and writing a
    version with a head of the campaign's own) takes seconds for a large
    model, and on the embedded database a transaction that long holds every
    other writer (lease records, heartbeats) back.
    """
    draft = Campaign.objects.select_related("pretrained", "dataset").filter(pk=campaign_id, state=State.DRAFT).first()
    if draft is None or draft.pretrained_id is None:
        return None
    # The cheap checks first, on the draft as read: no weights are read for a start refused anyway, and
    # the refusal names what is wrong, not the weights. The checks under the lock still decide.
    _check_dataset_ready(draft)
    _check_trainable(draft)
    try:
        return initial_weights_inputs(draft), initial_weights_sha(draft)
    except OSError as exc:  # the stored weights gone or unreadable: say so, start nothing
        raise _unreadable(draft, exc) from None


def _unreadable(campaign: Campaign, exc: OSError) -> LifecycleError:
    return LifecycleError(f"the pretrained weights {campaign.pretrained} cannot be read ({exc}); upload them again")


def apply_move(campaign_id: int, name: str, by: Any) -> Campaign:
    """Move a campaign, under its row lock so two clicks cannot both succeed.

    Raises:
        LifecycleError: for an unknown move, or one the campaign's state does not allow.
    """
    move = MOVES.get(name)
    if move is None:
        raise LifecycleError(f"unknown action {name!r}; use one of {', '.join(MOVES)}")
    prepared = _prepare_weights(campaign_id) if move.target == State.RUNNING else None
    with transaction.atomic():
        # NO KEY: a state change must not block the foreign-key checks of lease rows being written meanwhile.
        locked = Campaign.objects.select_for_update(of=("self",), no_key=True)
        campaign = locked.select_related("dataset").get(pk=campaign_id)
        if campaign.state not in move.sources:
            allowed = " or ".join(sorted(move.sources))
            raise LifecycleError(
                f"cannot {name} a {campaign.state} campaign; {move.label} works on {allowed} campaigns"
            )
        if move.target == State.RUNNING:
            _check_dataset_ready(campaign)
            if campaign.state == State.DRAFT:
                _check_trainable(campaign)
                sha = prepared[1] if prepared is not None and prepared[0] == initial_weights_inputs(campaign) else None
                try:  # computed here only if the campaign changed while they were prepared
                    prepare_initial_weights(campaign, sha)
                except OSError as exc:
                    raise _unreadable(campaign, exc) from None
            if campaign.max_steps is not None and campaign.committed_steps >= campaign.max_steps:
                raise LifecycleError(
                    f"the campaign already made its {campaign.max_steps} max steps; raise max steps before resuming"
                )
        campaign.state = move.target
        campaign.save(update_fields=["state", *campaign.stamp_state()])
        if move.target == State.RUNNING:
            # Tabs are offered its work once its model's graphs pass: checked by a task after this commits
            # (a resume only asks again if an earlier check was lost; a decided one costs one query).
            check_for_browsers(campaign)
        if move.target == State.FINISHED and campaign.version > 0:
            # A campaign finished by hand between validation rounds still gets its last version's
            # loss, and with it an export of the weights it ended with (after this commits).
            if not campaign.validation_results.filter(version=campaign.version).exists():
                schedule_validation(campaign.pk, campaign.version)
    logger.info("campaign %s: %s by user %s (now %s)", campaign.pk, name, getattr(by, "pk", None), campaign.state)
    if move.target == State.RUNNING:
        # The gateway, above us, gives live aggregators their slices now (not at their next heartbeat) and
        # wakes agents told "paused, ask again in 10 s": resuming takes effect at once.
        campaign_running.send(sender=Campaign, campaign_id=campaign.pk, version=campaign.version)
    return campaign
