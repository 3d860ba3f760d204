"""Datasets, their shards, uploads and their chunks, and uploaded pretrained weights.

These models moved here from ``campaigns`` without touching the database:
each keeps its ``campaigns_*`` table (``Meta.db_table``), and the migrations
only move them in Django's state.
"""

from __future__ import annotations

import bisect
import functools
import uuid
from dataclasses import dataclass

from django.conf import settings
from django.db import models
from django.utils import timezone

from crowdtrain_agent.protocol import DataSpec


class Dataset(models.Model):
    """A training corpus split into content-addressed shards, in a fixed sample order."""

    class Kind(models.TextChoices):
        TEXT = "text", "text (byte-level)"
        TENSORS = "tensors", "tensors (x, y)"
        TOKENS = "tokens", "tokens (tokenized text)"

    class Status(models.TextChoices):
        PENDING = "pending"
        SHARDING = "sharding"
        READY = "ready"
        FAILED = "failed"

    class Format(models.TextChoices):
        """The uploaded file's format; ``kind`` is what the shards hold."""

        TEXT = "text", "plain text (.txt)"
        NPZ = "npz", ".npz with arrays x and y"
        JSONL = "jsonl", "JSON lines with a text field"
        IMAGES = "images", "images: a .zip or .tar of class folders, or a WebDataset .tar"

    name = models.CharField(max_length=200)
    # Null for datasets made in code (the demo, seed_run); uploads always have one.
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="datasets"
    )
    kind = models.CharField(max_length=16, choices=Kind.choices)
    sample_len = models.PositiveIntegerField(default=0, help_text="bytes (text) or token ids (tokens) per sample")
    # A tokens dataset: the sha256 of the tokenizer.json that made its ids (stored like a shard), its
    # vocabulary, and the bytes of one stored id.
    tokenizer_sha256 = models.CharField(max_length=64, blank=True, db_index=True)
    vocab_size = models.PositiveIntegerField(default=0)
    token_bytes = models.PositiveSmallIntegerField(default=0)
    # An images dataset: the side of its square images, and its class names in label order.
    image_size = models.PositiveIntegerField(default=0)
    labels = models.JSONField(default=list, blank=True)
    # Files of an upload that could not be used (the first SKIPPED_NAMED, with why), and how many in all.
    skipped = models.JSONField(default=list, blank=True)
    skipped_count = models.PositiveIntegerField(default=0)
    source_sha256 = models.CharField(max_length=64, blank=True, db_index=True)
    source_format = models.CharField(max_length=16, choices=Format.choices, blank=True)
    text_field = models.CharField(max_length=100, blank=True, help_text="the JSONL field holding the text")
    validation_fraction = models.FloatField(default=0.0)
    num_samples = models.BigIntegerField(default=0, help_text="training samples (the validation split not included)")
    num_validation_samples = models.BigIntegerField(default=0)
    size_bytes = models.BigIntegerField(default=0)
    # Datasets made in code are ready when saved; uploads go pending -> sharding -> ready | failed.
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.READY)
    progress = models.FloatField(default=1.0, help_text="0..1 while sharding")
    stage = models.CharField(max_length=64, blank=True, help_text="what sharding is doing now, for the page")
    error = models.TextField(blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "campaigns_dataset"

    def __str__(self) -> str:
        return self.name

    def data_spec(self, augment: str = "none") -> DataSpec:
        """How agents (``augment``: the campaign's augmentation) and the validation task read the shards."""
        return DataSpec(
            kind=self.kind,  # type: ignore[arg-type]
            sample_len=self.sample_len,
            token_bytes=self.token_bytes,  # type: ignore[arg-type]
            vocab_size=self.vocab_size,
            tokenizer=self.tokenizer_sha256,
            augment=augment,  # type: ignore[arg-type]
        )

    def train_shards(self) -> models.QuerySet[Shard]:
        """The shards the scheduler leases, in sample order."""
        return self.shards.filter(split=Shard.Split.TRAIN).order_by("index")

    def validation_shards(self) -> models.QuerySet[Shard]:
        """The held-out shards, in sample order; their ``first_sample`` counts from 0 within the split."""
        return self.shards.filter(split=Shard.Split.VALIDATION).order_by("index")


class Pretrained(models.Model):
    """Weights an organizer uploaded (a ``transformers`` folder) that a campaign can start from.

    ``architecture`` and ``model_config`` are the registry's reading of the
    folder's ``config.json``; the weights are stored as one fp32 vector in the
    flat parameter order (``pretrained.weights_storage_name``).
    """

    class Status(models.TextChoices):
        PENDING = "pending"
        CONVERTING = "converting"
        READY = "ready"
        FAILED = "failed"

    name = models.CharField(max_length=200)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="pretrained")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    progress = models.FloatField(default=0.0)
    error = models.TextField(blank=True)
    architecture = models.CharField(max_length=64, blank=True)
    model_config = models.JSONField(default=dict, blank=True)
    param_count = models.BigIntegerField(default=0)
    weights_sha256 = models.CharField(max_length=64, blank=True)
    tokenizer_sha256 = models.CharField(max_length=64, blank=True)
    labels = models.JSONField(default=list, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "campaigns_pretrained"
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} ({self.architecture or 'pretrained'})"


class Shard(models.Model):
    """Samples ``first_sample : first_sample + num_samples`` of a dataset, stored by sha256."""

    class Split(models.TextChoices):
        TRAIN = "train"
        VALIDATION = "validation"

    dataset = models.ForeignKey(Dataset, on_delete=models.CASCADE, related_name="shards")
    # Each split numbers its shards and samples from 0; the scheduler sees only "train".
    split = models.CharField(max_length=16, choices=Split.choices, default=Split.TRAIN)
    index = models.PositiveIntegerField()
    sha256 = models.CharField(max_length=64, db_index=True)
    first_sample = models.BigIntegerField()
    num_samples = models.PositiveIntegerField()
    size_bytes = models.BigIntegerField()

    class Meta:
        db_table = "campaigns_shard"
        ordering = ["dataset", "split", "index"]
        constraints = [
            models.UniqueConstraint(fields=["dataset", "split", "index"], name="unique_shard_index_per_split")
        ]

    def __str__(self) -> str:
        return f"{self.dataset} #{self.index} ({self.sha256[:12]})"

    @property
    def storage_name(self) -> str:
        return shard_storage_name(self.sha256)


def shard_storage_name(sha256: str) -> str:
    return f"shards/{sha256[:2]}/{sha256}"


@dataclass(frozen=True)
class ShardTable:
    """A dataset's shards in sample order: what the scheduler looks up on every lease."""

    first_samples: tuple[int, ...]
    sizes: tuple[int, ...]
    sha256s: tuple[str, ...]

    def locate(self, sample: int) -> int:
        """Index of the shard holding global sample ``sample``."""
        return bisect.bisect_right(self.first_samples, sample) - 1


def shard_table(dataset: Dataset) -> ShardTable:
    """Cached per process: a dataset's shards never change once it is created."""
    # The creation time is in the key because ids can come back (rolled-back test transactions).
    return _shard_table(dataset.pk, dataset.created_at.isoformat())


@functools.lru_cache(maxsize=256)
def _shard_table(dataset_id: int, created_at: str) -> ShardTable:
    rows = list(
        Shard.objects.filter(dataset_id=dataset_id, split=Shard.Split.TRAIN)
        .order_by("index")
        .values_list("first_sample", "num_samples", "sha256")
    )
    return ShardTable(tuple(r[0] for r in rows), tuple(r[1] for r in rows), tuple(r[2] for r in rows))


class Upload(models.Model):
    """A dataset file arriving in chunks; each chunk is its own storage object, so S3 needs nothing special.

    ``received`` is the authority on what has arrived: a chunk object without
    a row (a crash between the two writes) is ignored and overwritten on resume.
    """

    class State(models.TextChoices):
        RECEIVING = "receiving"
        COMPLETE = "complete"  # all bytes in; the sharding task owns it now

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="uploads")
    name = models.CharField(max_length=200, help_text="the dataset's name")
    filename = models.CharField(max_length=255)
    size = models.BigIntegerField(help_text="declared size in bytes")
    sha256 = models.CharField(max_length=64, blank=True, help_text="declared sha256, checked when sharding")
    # A dataset's format, or PRETRAINED: a zipped transformers folder of weights to start a campaign from.
    PRETRAINED = "pretrained"
    FORMATS = (*Dataset.Format.choices, (PRETRAINED, "pretrained weights: a zipped transformers folder"))
    format = models.CharField(max_length=16, choices=FORMATS)
    text_field = models.CharField(max_length=100, default="text")
    sample_len = models.PositiveIntegerField(default=0)
    # Text: "" keeps bytes, "train" trains a BPE tokenizer of ``vocab_size`` tokens on the upload, a sha256
    # names a tokenizer.json uploaded before. Images: the side they are resized to.
    tokenizer = models.CharField(max_length=64, blank=True)
    vocab_size = models.PositiveIntegerField(default=0)
    image_size = models.PositiveIntegerField(default=0)
    received = models.BigIntegerField(default=0)
    state = models.CharField(max_length=16, choices=State.choices, default=State.RECEIVING)
    dataset = models.ForeignKey(Dataset, null=True, blank=True, on_delete=models.SET_NULL, related_name="uploads")
    # A "pretrained" upload (a zipped transformers folder) becomes this instead of a dataset.
    pretrained = models.ForeignKey(Pretrained, null=True, blank=True, on_delete=models.SET_NULL, related_name="uploads")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "campaigns_upload"
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.filename} ({self.received}/{self.size})"

    @property
    def storage_prefix(self) -> str:
        return f"uploads/{self.pk}"


class UploadChunk(models.Model):
    """Bytes ``offset : offset + size`` of an upload, stored as one object named ``name``."""

    upload = models.ForeignKey(Upload, on_delete=models.CASCADE, related_name="chunks")
    offset = models.BigIntegerField()
    size = models.PositiveIntegerField()
    name = models.CharField(max_length=255)

    class Meta:
        db_table = "campaigns_uploadchunk"
        ordering = ["upload", "offset"]
        constraints = [models.UniqueConstraint(fields=["upload", "offset"], name="unique_upload_chunk_offset")]
