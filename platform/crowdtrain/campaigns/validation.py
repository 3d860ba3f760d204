"""The held-out loss of a campaign's parameters, and the site's own copy of those parameters for export.

Every ``validate_every`` applied steps (and when the campaign finishes) the
site fetches the parameters of the new version from the aggregators' params
endpoints, as an agent would, and:

- stores them as a safetensors file in default storage (local media or S3):
  this is the version's *export*, kept by the site, so downloading a model
  never depends on an aggregator still retaining that version or being up;
- evaluates the mean loss over at most ``CROWDTRAIN_VALIDATION_SAMPLES``
  samples of the dataset's validation split, from exactly those bytes, so an
  exported model reproduces the loss the page shows.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterator

import torch
from django.conf import settings
from django.core.files.base import ContentFile
from django.core.files.storage import default_storage
from django.db import connection, transaction
from django.utils import timezone

from crowdtrain.campaigns.keys import ticket_key
from crowdtrain.datasets.models import Dataset
from crowdtrain_agent.data import ShardReader
from crowdtrain_agent.fetch import FetchError, fetch_params
from crowdtrain_agent.models import ModelEntry, export_bytes, get_model, model_from_flat
from crowdtrain_agent.protocol import ProtocolError, SliceRoute, Ticket, sign_ticket

from .models import Campaign, ValidationResult
from .signals import campaign_changed

logger = logging.getLogger(__name__)

EVAL_BATCH = 64  # samples per forward pass; bounds the task's memory, not its result
PARAMS_TICKET_S = 300.0  # how long the site's ticket for fetching parameters is good for


class ParamsUnavailable(RuntimeError):
    """The aggregators cannot serve the version (gone, or it fell out of their retained window)."""


def export_name(campaign_id: int, version: int) -> str:
    """Storage name of the exported parameters of one version."""
    return f"exports/campaign-{campaign_id}/v{version:08d}.safetensors"


def fetch_campaign_params(campaign: Campaign, version: int) -> torch.Tensor:
    """The flat parameter vector of ``version``, assembled from every aggregator's slice.

    Raises:
        ParamsUnavailable: if the slices are not all assigned or a download fails.
    """
    slices = list(campaign.slices.select_related("aggregator").order_by("index"))
    routes = [
        SliceRoute(
            index=s.index,
            start=s.start,
            end=s.end,
            upload_url=s.aggregator.upload_url,
            params_url=f"{s.aggregator.params_url}{campaign.pk}/{s.index}/",
        )
        for s in slices
    ]
    # The site's own ticket for this campaign: aggregators serve parameters only to ticket holders.
    ticket = sign_ticket(
        Ticket(
            lease_id=0,
            campaign_id=campaign.pk,
            device_id=0,
            base_version=version,
            num_samples=1,
            expires_at=time.time() + PARAMS_TICKET_S,
        ),
        ticket_key(campaign.pk),
    )
    try:
        return fetch_params(routes, version, campaign.param_count, ticket=ticket)
    except FetchError as exc:
        raise ParamsUnavailable(f"campaign {campaign.pk} version {version}: {exc}") from None


def validation_samples(dataset: Dataset, limit: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of the first ``limit`` samples of the validation split, in shard order (the same every time)."""
    spec = dataset.data_spec()
    left = limit
    for shard in dataset.validation_shards():
        if left <= 0:
            return
        with default_storage.open(shard.storage_name, "rb") as fh:
            reader = ShardReader(spec, fh.read())
        take = min(left, reader.count)
        for start in range(0, take, EVAL_BATCH):
            yield reader.read(start, min(EVAL_BATCH, take - start))
        left -= take


@torch.no_grad()
def mean_loss(
    entry: ModelEntry, model: torch.nn.Module, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[float, int]:
    """Mean per-sample loss of ``model`` over ``batches``, accumulated in float64.

    Returns:
        (mean loss, samples seen); the mean is NaN when there are no samples.
    """
    model.eval()
    total, count = 0.0, 0
    for x, y in batches:
        total += float(entry.loss_sum(model, x, y).double())
        count += int(y.shape[0])
    return (total / count if count else math.nan), count


def compute(campaign_id: int, version: int) -> ValidationResult | None:
    """Store the exported parameters and the validation loss of one version; idempotent.

    Returns:
        The result, or None if the campaign has gone or the version cannot be fetched any more.
    """
    campaign = Campaign.objects.select_related("dataset").filter(pk=campaign_id).first()
    if campaign is None:
        return None
    done = ValidationResult.objects.filter(campaign=campaign, version=version).first()
    if done is not None:
        return done
    try:
        flat = fetch_campaign_params(campaign, version)
    except ParamsUnavailable as exc:
        # A newer version will be validated at its turn; an older one cannot come back.
        logger.warning("no validation loss for %s", exc)
        return None
    entry = get_model(campaign.architecture)
    model = model_from_flat(campaign.architecture, campaign.model_config, flat)

    # Export first: the loss is then computed from the very parameters a download gives.
    name = export_name(campaign.pk, version)
    if default_storage.exists(name):
        default_storage.delete(name)  # a half-finished earlier run; the local storage would rename, not overwrite
    saved = default_storage.save(
        name, ContentFile(export_bytes(model, {"campaign": str(campaign.pk), "version": str(version)}))
    )
    try:
        samples = validation_samples(campaign.dataset, settings.CROWDTRAIN_VALIDATION_SAMPLES)
        loss, count = mean_loss(entry, model, samples)
    except (ProtocolError, OSError) as exc:
        logger.error("campaign %s: cannot read the validation split of %s: %s", campaign.pk, campaign.dataset, exc)
        loss, count = math.nan, 0
    result, _ = ValidationResult.objects.update_or_create(
        campaign=campaign,
        version=version,
        defaults={
            "loss": None if math.isnan(loss) else loss,
            "num_samples": count,
            "weights": saved,
            "computed_at": timezone.now(),
        },
    )
    logger.info(
        "campaign %s: validation loss %s over %s samples at version %s", campaign.pk, result.loss, count, version
    )
    prune_exports(campaign)
    if result.loss is not None and campaign.target_val_loss is not None and result.loss <= campaign.target_val_loss:
        finished = Campaign.objects.filter(pk=campaign.pk, state=Campaign.State.RUNNING).update(
            state=Campaign.State.FINISHED, finished_at=timezone.now()
        )
        if finished:
            campaign_changed.send(sender=Campaign, campaign_id=campaign.pk)  # the scheduler stops leasing it
            logger.info(
                "campaign %s reached its target validation loss %s: finished", campaign.pk, campaign.target_val_loss
            )
    return result


def prune_exports(campaign: Campaign) -> list[int]:
    """Delete the weights of all but the newest ``CROWDTRAIN_EXPORTS_KEPT`` versions; their losses stay.

    Returns:
        The versions whose weights were deleted.
    """
    stored = campaign.validation_results.exclude(weights="").order_by("-version")
    old = list(stored[settings.CROWDTRAIN_EXPORTS_KEPT :])
    for result in old:
        default_storage.delete(result.weights)
        result.weights = ""
        result.save(update_fields=["weights"])
    return [r.version for r in old]


def due(campaign: Campaign, old_version: int, new_version: int, finished: bool) -> bool:
    """Whether publishing ``new_version`` (after ``old_version``) calls for a validation loss."""
    every = campaign.validate_every
    crossed = every > 0 and new_version // every > old_version // every
    return new_version > 0 and (crossed or finished)


def schedule_validation(campaign_id: int, version: int) -> None:
    """Queue ``compute_validation_loss`` once the caller's transaction commits.

    With a real broker the task goes to a worker. With eager Celery (the
    embedded default) ``delay`` would run it right here, inside the backbone
    consumer that applied the step, and stall it for the whole fetch and
    forward pass; so in eager mode it runs in a daemon thread instead.
    """
    from .tasks import compute_validation_loss  # tasks imports this module

    def dispatch() -> None:
        if settings.CELERY_TASK_ALWAYS_EAGER:
            threading.Thread(
                target=_run_in_thread,
                args=(campaign_id, version),
                name=f"validate-{campaign_id}-{version}",
                daemon=True,
            ).start()
        else:
            compute_validation_loss.delay(campaign_id, version)

    transaction.on_commit(dispatch)


def _run_in_thread(campaign_id: int, version: int) -> None:
    try:
        compute(campaign_id, version)
    except Exception:
        logger.exception("validation of campaign %s version %s failed", campaign_id, version)
    finally:
        connection.close()  # this thread's connection would otherwise stay open until exit
