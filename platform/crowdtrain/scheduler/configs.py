"""What the lease path needs to know of a campaign, cached per process, and whether it may lease now.

A lease or a done report must not query the database: the campaign's settings,
shards and slice routes are read once per process and kept until the
campaign's generation in Redis moves (every change of state, slices or
aggregators bumps it through ``publish_state``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import cast

import msgspec
from django.conf import settings
from django.db import transaction
from django.db.models import Exists, Q

from crowdtrain.accounts.models import Device
from crowdtrain.campaigns.keys import ticket_key
from crowdtrain.campaigns.models import Campaign
from crowdtrain.campaigns.settings_table import acted_on
from crowdtrain.campaigns.setup import inner_optimizer_spec
from crowdtrain.datasets.models import ShardTable, shard_table
from crowdtrain_agent.models import get_model
from crowdtrain_agent.protocol import (
    CodecName,
    DataSpec,
    ModelSpec,
    OptimizerSpec,
    SliceRoute,
    TrainingMode,
    trim_count,
)
from crowdtrain_agent.protocol.schema import from_dict

from .durability import hold_fields
from .hotstate import HotStateMissing, hot_state
from .models import SliceAssignment

logger = logging.getLogger(__name__)

# Cached answers to "may this device work on that invite-only campaign" live this long.
ACCESS_TTL_S = 30.0


@dataclass(frozen=True)
class CampaignConfig:
    """A campaign as the lease path sees it: settings that lock when it starts, and where its slices live."""

    id: int
    hot_key: str
    gen: int  # the generation in Redis this copy was read at
    state: str
    public: bool
    target_batch_size: int
    microbatch_size: int
    staleness: int
    max_steps: int | None
    codec: CodecName
    codec_block_size: int
    model: ModelSpec
    flops_per_sample: float
    data: DataSpec
    param_count: int
    num_samples: int
    table: ShardTable
    slices: tuple[SliceRoute, ...]
    aggregator_ids: tuple[int, ...]
    ticket_key: bytes  # signs the campaign's tickets and checks its receipts (``ticket_key``)
    check_fraction: float = 0.05  # share of leases verified by a copy (``crowdtrain.verification``)
    mode: TrainingMode = "sync"
    inner: OptimizerSpec | None = None  # local mode's inner optimizer, its lr unscheduled (``inner_for``)
    schedule: OptimizerSpec | None = None  # the campaign's optimizer, whose schedule the inner lr follows
    inner_batch_size: int | None = None  # local mode: samples per inner step (None: one microbatch)
    owner_id: int = 0  # the organizer: their own devices are never on probation
    # The most leases of one step a volunteer on probation may hold (``probation_cap``); 0: no limit.
    probation_cap: int = 0
    mixed_precision: bool = False  # CUDA devices compute in bf16/fp16 autocast (``Lease.mixed_precision``)

    @property
    def lease_unit(self) -> int:
        """Lease sizes are multiples of this: whole microbatches, and in local mode whole inner steps."""
        return self.inner_batch_size or self.microbatch_size

    def inner_for(self, round_index: int) -> OptimizerSpec | None:
        """The inner optimizer of a lease of round ``round_index`` (its step): the schedule applied to its lr.

        The round, not the base version: an overlapped lease (``rebase_to``) trains round ``base_version + 1``.
        """
        if self.inner is None:
            return None
        factor = self.schedule.lr_multiplier(round_index) if self.schedule is not None else 1.0
        return msgspec.structs.replace(self.inner, lr=self.inner.lr * factor)


_cache: dict[int, CampaignConfig] = {}
_access: dict[tuple[int, int], tuple[float, bool]] = {}
_running: list[tuple[float, list[int]]] = [(0.0, [])]
_lock = threading.Lock()
# A campaign started in another site process is seen by this one within this long.
RUNNING_TTL_S = 1.0


def running_campaigns() -> list[int]:
    """Running campaigns, read at most once a second per process (and again after this process changes one)."""
    read_at, ids = _running[0]
    now = time.monotonic()
    if now - read_at > RUNNING_TTL_S:
        ids = list(Campaign.objects.filter(state=Campaign.State.RUNNING).order_by("id").values_list("id", flat=True))
        _running[0] = (now, ids)
    return ids


def _read(campaign_id: int, gen: int) -> CampaignConfig | None:
    campaign = Campaign.objects.select_related("dataset").filter(pk=campaign_id).first()
    if campaign is None:
        return None
    slices = list(
        SliceAssignment.objects.filter(campaign_id=campaign_id).select_related("aggregator").order_by("index")
    )
    spec = get_model(campaign.architecture)
    local = campaign.training_mode == Campaign.TrainingMode.LOCAL
    return CampaignConfig(
        id=campaign.pk,
        hot_key=campaign.hot_key.hex,
        gen=gen,
        state=campaign.state,
        public=campaign.visibility == Campaign.Visibility.PUBLIC,
        target_batch_size=campaign.target_batch_size,
        microbatch_size=campaign.microbatch_size,
        staleness=campaign.staleness,
        max_steps=campaign.max_steps,
        codec=cast(CodecName, campaign.codec),
        codec_block_size=campaign.codec_block_size,
        model=ModelSpec(architecture=campaign.architecture, config=spec.compact(campaign.model_config)),
        flops_per_sample=spec.flops_per_sample(campaign.model_config),
        data=campaign.dataset.data_spec(augment=campaign.augmentation),
        mixed_precision=campaign.mixed_precision,
        param_count=campaign.param_count,
        num_samples=campaign.dataset.num_samples,
        table=shard_table(campaign.dataset),
        slices=tuple(
            SliceRoute(
                index=s.index,
                start=s.start,
                end=s.end,
                upload_url=s.aggregator.upload_url,
                params_url=f"{s.aggregator.params_url}{campaign.pk}/{s.index}/",
            )
            for s in slices
        ),
        aggregator_ids=tuple(s.aggregator_id for s in slices),
        ticket_key=ticket_key(campaign.pk),
        # A rule between settings (local mode checks nothing) holds even for a value saved another way.
        check_fraction=acted_on(campaign, "check_fraction"),
        mode=cast(TrainingMode, campaign.training_mode),
        inner=inner_optimizer_spec(campaign.inner_optimizer, campaign.inner_lr, campaign.inner_weight_decay)
        if local
        else None,
        schedule=from_dict(OptimizerSpec, campaign.optimizer, "optimizer") if local else None,
        inner_batch_size=campaign.inner_batch_size if local else None,
        owner_id=campaign.owner_id,
        probation_cap=probation_cap(campaign),
    )


def most_lease_samples(unit: int) -> int:
    """CROWDTRAIN_MAX_LEASE_SAMPLES in whole units (a local lease's inner batches), and never below one unit."""
    return max(unit, settings.CROWDTRAIN_MAX_LEASE_SAMPLES // unit * unit)


def probation_cap(campaign: Campaign) -> int:
    """Leases of one step a volunteer on probation may hold: as many as the campaign's robust rule outvotes.

    A step holds at least ``target / largest lease`` leases. The trimmed mean drops
    ``trim_count`` of them at each end of every coordinate, and centered clipping
    bounds any minority's pull, so a volunteer holding no more than that cannot
    drag a step whatever they upload. Only while verification can end the
    probation: a campaign that checks nothing (``settings_table.RULES`` may force that), or takes the plain
    mean, has none.
    """
    if acted_on(campaign, "check_fraction") <= 0 or campaign.aggregation == Campaign.Aggregation.MEAN:
        return 0
    fewest = -(-campaign.target_batch_size // most_lease_samples(campaign.microbatch_size))
    if campaign.aggregation == Campaign.Aggregation.TRIMMED_MEAN:
        outvoted = trim_count(fewest, campaign.trim_fraction)
    else:
        outvoted = (fewest - 1) // 2
    # A step too small for its rule to outvote anyone still lets a newcomer hold one lease of it.
    return max(1, outvoted)


def campaign_config(campaign_id: int, *, gen: int | None = None) -> CampaignConfig | None:
    """The cached campaign, read again when Redis names a newer generation (``gen``) than the copy's."""
    cached = _cache.get(campaign_id)
    if cached is not None and (gen is None or cached.gen >= gen):
        return cached
    fresh = _read(campaign_id, gen if gen is not None else (cached.gen if cached else -1))
    with _lock:
        if fresh is None:
            _cache.pop(campaign_id, None)
        else:
            _cache[campaign_id] = fresh
    return fresh


def forget(campaign_id: int) -> None:
    with _lock:
        _cache.pop(campaign_id, None)
        _running[0] = (0.0, [])


def clear_caches() -> None:
    with _lock:
        _cache.clear()
        _access.clear()
        _running[0] = (0.0, [])


def open_to(config: CampaignConfig, device_id: int) -> bool:
    """Public campaigns cost nothing; invite-only ones one query per device every ACCESS_TTL_S."""
    if config.public:
        return True
    now = time.monotonic()
    hit = _access.get((config.id, device_id))
    if hit is not None and now - hit[0] < ACCESS_TTL_S:
        return hit[1]
    allowed = Campaign.objects.filter(pk=config.id).filter(open_q(device_id)).exists()
    _access[(config.id, device_id)] = (now, allowed)
    return allowed


def open_q(device_id: int) -> Q:
    """Campaigns this device may work on: public ones, and invite-only ones its volunteer owns or was invited to."""
    staff = Exists(Device.objects.filter(pk=device_id, owner__is_staff=True))
    return (
        Q(visibility=Campaign.Visibility.PUBLIC)
        | Q(owner__devices=device_id)
        | Q(invited__devices=device_id)
        | Q(staff)
    )


def run_state(campaign: Campaign) -> tuple[bool, str]:
    """Whether the campaign may lease now (running, with every slice on a connected aggregator), and why not."""
    if campaign.state in (Campaign.State.FINISHED, Campaign.State.ARCHIVED):
        return False, f"campaign {campaign.pk} has finished"
    if campaign.state != Campaign.State.RUNNING:
        return False, f"campaign {campaign.pk} is {campaign.state}"
    slices = list(campaign.slices.select_related("aggregator"))
    ready = [s for s in slices if s.ready and s.aggregator.connected]
    if len(slices) < campaign.num_aggregators or len(ready) < len(slices):
        return (
            False,
            f"campaign {campaign.pk}: waiting for aggregators: {len(ready)} of {campaign.num_aggregators} slices ready",
        )
    return True, ""


def hot_fields(campaign: Campaign) -> dict[str, object]:
    """The campaign's settings the scheduler's scripts read from its hot state (``configure`` and ``load``).

    ``hold``: the first step that may not commit while checkpoints lag (``durability``), with the
    words volunteers get for it (``hold_why``); leases for that step are refused with them too.
    """
    return {
        "target": campaign.target_batch_size,
        "stale": campaign.staleness,
        "state": campaign.state,
        "max": -1 if campaign.max_steps is None else campaign.max_steps,
        **hold_fields(campaign),
    }


def publish_hold(campaign: Campaign) -> None:
    """Move the campaign's checkpoint hold after a checkpoint completed; nothing else changes, no copy is re-read."""
    try:
        hot_state().run("configure", campaign.hot_key.hex, {"quiet": True, "fields": hold_fields(campaign)})
    except HotStateMissing:
        pass


def publish_state(campaign_id: int) -> None:
    """Tell every site process what changed: lease or not, and re-read the campaign (its generation moves).

    Called after a campaign's state, slices or aggregators change. A campaign
    without hot state yet needs nothing: loading it computes the same.

    Inside a transaction it waits for the commit. Published before, it would
    read rows no other process sees yet; a process rebuilding the hot state in
    between would then install what it still sees (a slice not ready, say),
    and nothing would come to correct it: the campaign would wait for ever.
    """
    transaction.on_commit(lambda: _publish_now(campaign_id))


def _publish_now(campaign_id: int) -> None:
    campaign = Campaign.objects.filter(pk=campaign_id).select_related("dataset").first()
    forget(campaign_id)
    if campaign is None:
        return
    run, why = run_state(campaign)
    fields = hot_fields(campaign)
    try:
        hot_state().run("configure", campaign.hot_key.hex, {"run": int(run), "why": why, "fields": fields})
    except HotStateMissing:
        pass
    logger.debug("campaign %s: %s", campaign_id, "leasing" if run else why)
