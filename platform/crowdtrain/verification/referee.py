"""The referee: the operator's own recomputation of a lease, which decides what volunteers cannot.

Two answers that disagree say only that one of them is wrong, and a vote among
volunteers lets two accounts of one person outvote an honest third. So a
dispute, a copy by a volunteer much like the original's (``affinity``), and a
check nobody copied in time go to the referee. It runs where the operator's
own processes run (the Celery worker; with eager Celery, a daemon thread of
the site process), recomputes the lease with the agent's own code on the CPU
from the same samples and base version, sends the gradient through the
campaign's codec as an upload would be, and sketches each slice with the seed
the aggregators used. Each answer is judged against that sketch alone, with
the tolerances volunteers are judged with, so fp16 transport and another
device's summation order count against nobody.

The aggregators keep a few versions only and a dispute may come after its base
version left them: when a check opens the site keeps its base version
(``keep``), once per version, until no open check needs it (``prune``), at
most ``CROWDTRAIN_REFEREE_VERSIONS_KEPT`` per campaign. Rulings are bounded per
campaign and per volunteer per hour: a dispute over a bound waits, and after
``CROWDTRAIN_REFEREE_WAIT_S`` ends *unruled* (nobody judged, the original's
credit withheld, as one of two answers was wrong); a check that merely went
uncopied is given up at once instead. With eager Celery the work runs on one
thread of the site process, one ruling at a time, so a burst of disputes
queues instead of taking the sockets' CPU.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
from django.conf import settings
from django.core.files.base import ContentFile
from django.core.files.storage import default_storage
from django.db import IntegrityError, connection, transaction
from django.db.models import Exists, OuterRef
from django.utils import timezone
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from crowdtrain.campaigns.models import Campaign
from crowdtrain.datasets.models import shard_storage_name
from crowdtrain.scheduler.configs import CampaignConfig, campaign_config
from crowdtrain_agent import trainer
from crowdtrain_agent.codec import get_codec
from crowdtrain_agent.data import ShardReader
from crowdtrain_agent.models import get_model
from crowdtrain_agent.protocol import ProtocolError, SampleRange
from crowdtrain_agent.sketch import SKETCH_COORDINATES, sketch, sketch_seed

from .models import OPEN_STATES, Answer, Check, KeptVersion

logger = logging.getLogger(__name__)

# A process asks for a version to be kept once in this long (each check of a step would ask again).
KEEP_ASKED_S = 300.0
# A ruling whose recomputation began this long ago and never ended (its worker died) is started again.
RULING_STUCK_S = 1800.0
# A kept version is pruned only once no check on it opened for this long: a process that asked to keep it
# asks again only after KEEP_ASKED_S, so a check opening meanwhile must find it still there.
PRUNE_GRACE_S = KEEP_ASKED_S + 60.0
HOUR = timedelta(hours=1)

_asked: dict[tuple[int, int], float] = {}
_asked_lock = threading.Lock()
# With eager Celery: one thread for rulings (a recomputation is a lease's compute) and one for keeping
# versions (a download). Apart, so a version is fetched while the aggregators still serve it, not after
# the rulings queued before it (behind them, keeps met 410 Gone and their disputes ended unruled).
_executors: dict[str, ThreadPoolExecutor] = {}


class CannotRule(RuntimeError):
    """The referee cannot recompute the lease (its base version was not kept, its samples cannot be read)."""


def kept_name(campaign_id: int, version: int) -> str:
    return f"referee/campaign-{campaign_id}/v{version:08d}.safetensors"


# ------------------------------------------------------------------ base versions


def keep(campaign_id: int, version: int) -> None:
    """Have a version kept for the referee once the caller's transaction commits: a check of it just opened."""
    if settings.CROWDTRAIN_REFEREE_VERSIONS_KEPT <= 0:
        return
    now = time.monotonic()
    with _asked_lock:
        if _asked.get((campaign_id, version), 0.0) > now:
            return
        if len(_asked) > 4096:
            for key in [k for k, until in _asked.items() if until <= now]:
                del _asked[key]
        _asked[(campaign_id, version)] = now + KEEP_ASKED_S
    from crowdtrain.scheduler.hotstate import hot_state

    from .tasks import keep_version

    def ask() -> None:
        state = hot_state()  # one process of all asks for it, not every one whose check opened on it
        if state.client.set(f"{state.prefix}:keep:{campaign_id}:{version}", 1, nx=True, ex=int(KEEP_ASKED_S)):
            in_background(keep_version, campaign_id, version, lane="keep")

    transaction.on_commit(ask)


def store(campaign_id: int, version: int) -> bool:
    """Fetch a version from the aggregators and keep it; whether it is kept now. Idempotent."""
    if KeptVersion.objects.filter(campaign_id=campaign_id, version=version).exists():
        return True
    campaign = Campaign.objects.filter(pk=campaign_id).first()
    if campaign is None:
        return False
    held = KeptVersion.objects.filter(campaign_id=campaign_id).count()
    if held >= settings.CROWDTRAIN_REFEREE_VERSIONS_KEPT:
        logger.warning(
            "campaign %s: the referee keeps %s versions already (CROWDTRAIN_REFEREE_VERSIONS_KEPT); disputes of "
            "checks on version %s will end with no verdict",
            campaign_id,
            held,
            version,
        )
        return False
    from crowdtrain.campaigns.validation import ParamsUnavailable, fetch_campaign_params

    try:
        flat = fetch_campaign_params(campaign, version)
    except ParamsUnavailable as exc:
        logger.warning("the referee could not keep %s; disputes of its checks will end with no verdict", exc)
        return False
    name = default_storage.save(kept_name(campaign_id, version), ContentFile(save_tensors({"params": flat})))
    try:
        KeptVersion.objects.create(campaign_id=campaign_id, version=version, name=name)
    except IntegrityError:  # another process kept it meanwhile
        default_storage.delete(name)
    return True


def prune() -> int:
    """Delete kept versions no open check needs any more; returns how many."""
    recent = timezone.now() - timedelta(seconds=PRUNE_GRACE_S)
    on_it = Check.objects.filter(campaign_id=OuterRef("campaign_id"), base_version=OuterRef("version"))
    needed = on_it.filter(state__in=OPEN_STATES) | on_it.filter(created_at__gte=recent)
    old = KeptVersion.objects.filter(created_at__lt=recent)
    done = 0
    for kept in old.exclude(Exists(needed))[:500]:
        default_storage.delete(kept.name)
        kept.delete()
        done += 1
    return done


def _params(case: Check) -> torch.Tensor:
    kept = KeptVersion.objects.filter(campaign_id=case.campaign_id, version=case.base_version).first()
    if kept is None:
        raise CannotRule(f"version {case.base_version} was not kept (the aggregators had let it go first)")
    try:
        with default_storage.open(kept.name, "rb") as fh:
            return load_tensors(fh.read())["params"]
    except Exception as exc:  # a lost or damaged file (safetensors raises its own error type)
        raise CannotRule(f"version {case.base_version} could not be read back: {exc}") from None


# ------------------------------------------------------------------ recomputation


def recompute(case: Check) -> list[float]:
    """The sketches, in slice order, the aggregators would make of an honest upload of the check's lease.

    Raises:
        CannotRule: if the base version was not kept, or the campaign or its samples are gone.
    """
    config = campaign_config(case.campaign_id)
    if config is None:
        raise CannotRule("the campaign is gone")
    flat = _params(case)
    entry = get_model(config.model.architecture)
    model = entry.build(config.model.config)
    model.train()
    cm = trainer.CampaignModel(
        spec=config.model, entry=entry, model=model, param_count=sum(p.numel() for p in model.parameters())
    )
    try:
        trainer.load_params_(cm, flat, case.base_version)
        x, y = _samples(config, case)
    except (ValueError, ProtocolError, OSError, IndexError) as exc:  # IndexError: a shard the table lost
        raise CannotRule(f"the lease's samples or parameters cannot be read: {exc}") from None
    grad = trainer.compute_gradient(cm, x, y, config.microbatch_size).grad
    codec = get_codec(config.codec, config.codec_block_size)
    values: list[float] = []
    for route in config.slices:
        piece = grad[route.start : route.end].contiguous()
        received = codec.decode(codec.encode(piece), piece.numel())  # what an aggregator decodes of it
        seed = sketch_seed(config.ticket_key, route.index, case.base_version)
        values += sketch(received, seed, coordinates=SKETCH_COORDINATES)
    return values


def _samples(config: CampaignConfig, case: Check) -> tuple[torch.Tensor, torch.Tensor]:
    """The lease's inputs and targets, read from the site's own shard storage as an agent reads its download."""
    shards = config.table.sha256s
    ranges = [SampleRange(shard=shards[s], start=start, count=count) for _, s, start, count in case.ranges]
    readers: dict[str, ShardReader] = {}
    for r in ranges:
        if r.shard not in readers:
            with default_storage.open(shard_storage_name(r.shard), "rb") as fh:
                readers[r.shard] = ShardReader(config.data, fh.read())
    return trainer.gather_samples(ranges, readers, augment=config.data.augment, version=case.base_version)


# ------------------------------------------------------------------ rulings


def call(check_id: int) -> None:
    """Have the referee rule on a check once the caller's transaction commits (it is in state ``referee``)."""
    from .tasks import referee_check

    transaction.on_commit(lambda: in_background(referee_check, check_id))


def in_background(task: Any, *args: Any, lane: str = "rule") -> None:
    """Send ``task`` to the Celery worker; with eager Celery (no broker) queue it for this process's referee
    thread of its ``lane`` ("rule" or "keep").

    Never inline: a recomputation takes as long as a lease, and the caller holds an agent's socket.
    """
    if settings.CELERY_TASK_ALWAYS_EAGER:
        with _asked_lock:
            executor = _executors.get(lane)
            if executor is None:
                executor = _executors[lane] = ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix=f"crowdtrain-referee-{lane}"
                )
            executor.submit(_run_closing, task.run, *args)
        return
    try:
        task.delay(*args)
    except Exception:  # the broker is away: the upkeep finds disputes that were never ruled on
        logger.warning("could not hand %s%s to the worker; the upkeep will", task.name, args, exc_info=True)


def _run_closing(work: Callable[..., Any], *args: Any) -> None:
    try:
        work(*args)
    except Exception:
        logger.exception("referee work %s%s failed", getattr(work, "__name__", work), args)
    finally:
        connection.close()  # this thread's connection would otherwise stay open until exit


def over_bound(case: Check) -> str:
    """Why the referee may not rule on this check now ("" if it may): a bound per hour is reached."""
    since = timezone.now() - HOUR
    ruled = Check.objects.filter(refereed_at__gte=since)
    if ruled.filter(campaign_id=case.campaign_id).count() >= settings.CROWDTRAIN_REFEREE_RULINGS_PER_HOUR:
        return f"the campaign had {settings.CROWDTRAIN_REFEREE_RULINGS_PER_HOUR} rulings in the last hour"
    limit = settings.CROWDTRAIN_REFEREE_VOLUNTEER_RULINGS_PER_HOUR
    for volunteer_id in set(case.answers.values_list("volunteer_id", flat=True)):
        if ruled.filter(answers__volunteer_id=volunteer_id).distinct().count() >= limit:
            return f"volunteer {volunteer_id} had {limit} rulings in the last hour"
    return ""


def rule(check_id: int) -> None:
    """Recompute a check sent to the referee and decide it (``checks.decide``); idempotent."""
    from . import checks

    case = Check.objects.filter(pk=check_id, state=Check.State.REFEREE).first()
    if case is None:
        return
    if case.refereed_at is not None and case.refereed_at > timezone.now() - timedelta(seconds=RULING_STUCK_S):
        return  # another worker is at it
    copied = case.answers.exclude(role=Answer.Role.ORIGINAL).exclude(sketch=[]).exists()
    bound = over_bound(case)
    if bound:
        if not copied:  # nothing disputed: given up as before the referee, at no cost
            checks.settle(case.pk, Check.State.ABANDONED, f"{case.detail}; the referee was busy ({bound})")
        else:
            logger.info("check %s waits for the referee: %s", case.pk, bound)
        return
    claimed = Check.objects.filter(pk=case.pk, state=Check.State.REFEREE, refereed_at=case.refereed_at).update(
        refereed_at=timezone.now()
    )
    if not claimed:
        return
    started = time.perf_counter()
    try:
        ruling = recompute(case)
    except CannotRule as exc:
        ended = Check.State.UNRULED if copied else Check.State.ABANDONED
        checks.settle(case.pk, ended, f"{case.detail}; the referee could not recompute it: {exc}")
        return
    took = time.perf_counter() - started
    logger.info("check %s: the referee recomputed lease %s in %.2f s", case.pk, case.lease_id, took)
    checks.decide(case.pk, ruling)


def waiting() -> int:
    """The upkeep's turn: disputes whose ruling never came or waits for a bound; returns how many were looked at.

    Past ``CROWDTRAIN_REFEREE_WAIT_S`` a dispute ends with no verdict on anyone.
    """
    from . import checks

    now = timezone.now()
    late = Check.objects.filter(
        state=Check.State.REFEREE, disputed_at__lt=now - timedelta(seconds=settings.CROWDTRAIN_REFEREE_WAIT_S)
    )
    for case in late[:200]:
        copied = case.answers.exclude(role=Answer.Role.ORIGINAL).exclude(sketch=[]).exists()
        ended = Check.State.UNRULED if copied else Check.State.ABANDONED
        checks.settle(case.pk, ended, f"{case.detail}; waited too long for the referee")
    due = Check.objects.filter(state=Check.State.REFEREE).exclude(
        refereed_at__gt=now - timedelta(seconds=RULING_STUCK_S)
    )
    due = due.filter(disputed_at__lt=now - timedelta(seconds=30)).order_by("disputed_at")
    from .tasks import referee_check

    ids = list(due.values_list("pk", flat=True)[:50])
    for check_id in ids:
        in_background(referee_check, check_id)
    return len(ids)


def clear_caches() -> None:
    """Forget which versions this process asked to keep (tests, whose campaign ids come back)."""
    with _asked_lock:
        _asked.clear()
