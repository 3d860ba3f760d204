"""Celery tasks of datasets: sharding an upload, converting uploaded weights, discarding abandoned uploads."""

from __future__ import annotations

import logging
import time
from datetime import timedelta

from celery import shared_task
from django.conf import settings
from django.utils import timezone

from . import pretrained, uploads
from .models import Dataset, Pretrained, Upload
from .sharding import DatasetError, copy_shards, shard_source

logger = logging.getLogger(__name__)

# The names these tasks had in crowdtrain.campaigns.tasks: messages queued before the move, and the beat
# schedule (crowdtrain.periodic), still name them so.
OLD_PREFIX = "crowdtrain.campaigns.tasks."


class _Progress:
    """Writes a dataset's progress at most once a second or per percent: the page polls it."""

    def __init__(self, dataset_id: int, start: float, end: float) -> None:
        self.dataset_id, self.start, self.end = dataset_id, start, end
        self._last_value, self._last_time = -1.0, 0.0

    def __call__(self, fraction: float) -> None:
        value = self.start + (self.end - self.start) * min(1.0, max(0.0, fraction))
        now = time.monotonic()
        if value - self._last_value >= 0.01 or now - self._last_time >= 1.0:
            Dataset.objects.filter(pk=self.dataset_id).update(progress=value)
            self._last_value, self._last_time = value, now


def _same_dataset(dataset: Dataset) -> Dataset | None:
    """A ready dataset made from the same bytes with the same recipe: its shards can be shared."""
    return (
        Dataset.objects.filter(
            status=Dataset.Status.READY,
            source_sha256=dataset.source_sha256,
            source_format=dataset.source_format,
            sample_len=dataset.sample_len,
            text_field=dataset.text_field,
            validation_fraction=dataset.validation_fraction,
            # the recipe's other ingredients: a trained tokenizer's file is not known yet, so such an upload
            # matches none and is tokenized anew
            kind=dataset.kind,
            tokenizer_sha256=dataset.tokenizer_sha256,
            vocab_size=dataset.vocab_size,
            image_size=dataset.image_size,
        )
        .exclude(pk=dataset.pk)
        .order_by("pk")
        .first()
    )


@shared_task(
    name=OLD_PREFIX + "shard_upload", autoretry_for=(OSError,), retry_backoff=True, retry_jitter=True, max_retries=3
)
def shard_upload(upload_id: str) -> str | None:
    """Split a completed upload into its dataset's shards; idempotent, skips vanished rows.

    Storage errors (OSError) are retried; a bad file is not: the dataset is
    marked failed with a message saying what is wrong, and the received bytes
    are deleted either way once the outcome is final.

    Returns:
        The dataset's final status, or None if the upload or its dataset is gone.
    """
    upload = Upload.objects.filter(pk=upload_id).select_related("dataset").first()
    if upload is None or upload.dataset is None:
        logger.info("upload %s or its dataset has disappeared; nothing to shard", upload_id)
        return None
    dataset = upload.dataset
    if dataset.status in (Dataset.Status.READY, Dataset.Status.FAILED):
        return dataset.status
    Dataset.objects.filter(pk=dataset.pk).update(status=Dataset.Status.SHARDING, progress=0.0, error="")
    try:
        dataset.source_sha256 = uploads.upload_sha256(upload, _Progress(dataset.pk, 0.0, 0.2))
        dataset.save(update_fields=["source_sha256"])
        if upload.sha256 and upload.sha256 != dataset.source_sha256:
            raise DatasetError(
                f"the file's sha256 is {dataset.source_sha256} but the upload declared {upload.sha256}; "
                "it changed or was damaged on the way, upload it again"
            )
        twin = _same_dataset(dataset)
        if twin is not None:
            # The same file again: share the stored shards instead of writing them a second time.
            copy_shards(twin, dataset)
            logger.info("upload %s: same bytes as dataset %s, shards shared", upload_id, twin.pk)
        else:
            shard_source(
                dataset, lambda: uploads.open_upload(upload), upload.size, progress=_Progress(dataset.pk, 0.2, 1.0)
            )
    except DatasetError as exc:
        Dataset.objects.filter(pk=dataset.pk).update(status=Dataset.Status.FAILED, error=str(exc))
        uploads.discard_chunks(upload)
        logger.info("upload %s refused: %s", upload_id, exc)
        return Dataset.Status.FAILED
    except OSError as exc:
        # Storage trouble, not the file's fault: retried, and the page says so meanwhile.
        Dataset.objects.filter(pk=dataset.pk).update(
            status=Dataset.Status.PENDING, error=f"storage error while sharding ({exc}); retrying"
        )
        raise
    except Exception as exc:
        Dataset.objects.filter(pk=dataset.pk).update(
            status=Dataset.Status.FAILED, error=f"internal error while sharding ({type(exc).__name__}); upload again"
        )
        raise
    Dataset.objects.filter(pk=dataset.pk).update(status=Dataset.Status.READY, progress=1.0, error="")
    uploads.discard_chunks(upload)
    return Dataset.Status.READY


@shared_task(
    name=OLD_PREFIX + "convert_pretrained_upload",
    autoretry_for=(OSError,),
    retry_backoff=True,
    retry_jitter=True,
    max_retries=3,
)
def convert_pretrained_upload(upload_id: str) -> str | None:
    """Check a zipped transformers folder and store its weights for campaigns to start from; idempotent.

    A folder the registry cannot build, or weights that do not fit its
    config, fail with the reason; storage errors are retried. The received
    bytes are deleted once the outcome is final.

    Returns:
        The final status, or None if the upload or its row is gone.
    """
    upload = Upload.objects.filter(pk=upload_id).select_related("pretrained").first()
    if upload is None or upload.pretrained is None:
        logger.info("upload %s or its pretrained weights have disappeared; nothing to convert", upload_id)
        return None
    target = Pretrained.objects.filter(pk=upload.pretrained.pk)
    if upload.pretrained.status in (Pretrained.Status.READY, Pretrained.Status.FAILED):
        return upload.pretrained.status
    target.update(status=Pretrained.Status.CONVERTING, progress=0.0, error="")

    def progress(fraction: float) -> None:
        target.update(progress=min(1.0, max(0.0, fraction)))

    try:
        with uploads.open_upload(upload) as fh:
            converted = pretrained.convert(fh, progress)
    except pretrained.PretrainedError as exc:
        target.update(status=Pretrained.Status.FAILED, error=str(exc))
        uploads.discard_chunks(upload)
        logger.info("pretrained upload %s refused: %s", upload_id, exc)
        return Pretrained.Status.FAILED
    except OSError as exc:
        target.update(status=Pretrained.Status.PENDING, error=f"storage error while converting ({exc}); retrying")
        raise
    except Exception as exc:
        why = f"internal error while converting ({type(exc).__name__}); upload again"
        target.update(status=Pretrained.Status.FAILED, error=why)
        raise
    target.update(**pretrained.record_fields(converted))
    uploads.discard_chunks(upload)
    return Pretrained.Status.READY


@shared_task(name=OLD_PREFIX + "discard_stale_uploads")
def discard_stale_uploads() -> int:
    """Delete uploads left unfinished past CROWDTRAIN_UPLOAD_EXPIRY_S, with their stored chunks; idempotent."""
    cutoff = timezone.now() - timedelta(seconds=settings.CROWDTRAIN_UPLOAD_EXPIRY_S)
    stale = list(Upload.objects.filter(state=Upload.State.RECEIVING, created_at__lt=cutoff))
    for upload in stale:
        uploads.discard_chunks(upload)
        upload.delete()
    if stale:
        logger.info("discarded %d unfinished uploads", len(stale))
    return len(stale)
