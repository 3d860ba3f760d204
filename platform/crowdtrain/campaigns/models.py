from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

from django.conf import settings
from django.db import models
from django.utils import timezone


class Dataset(models.Model):
    """A training corpus split into content-addressed shards, in a fixed sample order."""

    class Kind(models.TextChoices):
        TEXT = "text", "text (byte-level)"
        TENSORS = "tensors", "tensors (x, y)"

    name = models.CharField(max_length=200)
    kind = models.CharField(max_length=16, choices=Kind.choices)
    sample_len = models.PositiveIntegerField(default=0, help_text="bytes per sample of a text dataset")
    source_sha256 = models.CharField(max_length=64, blank=True, db_index=True)
    num_samples = models.BigIntegerField(default=0)
    size_bytes = models.BigIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return self.name


class Shard(models.Model):
    """Samples ``first_sample : first_sample + num_samples`` of a dataset, stored by sha256."""

    dataset = models.ForeignKey(Dataset, on_delete=models.CASCADE, related_name="shards")
    index = models.PositiveIntegerField()
    sha256 = models.CharField(max_length=64, db_index=True)
    first_sample = models.BigIntegerField()
    num_samples = models.PositiveIntegerField()
    size_bytes = models.BigIntegerField()

    class Meta:
        ordering = ["dataset", "index"]
        constraints = [models.UniqueConstraint(fields=["dataset", "index"], name="unique_shard_index")]

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
        Shard.objects.filter(dataset_id=dataset_id).order_by("index").values_list("first_sample", "num_samples", "sha256")
    )
    return ShardTable(tuple(r[0] for r in rows), tuple(r[1] for r in rows), tuple(r[2] for r in rows))


def default_optimizer() -> dict:
    return {"name": "adamw", "lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "momentum": 0.0}


class Campaign(models.Model):
    """One training run: a model from the registry, a dataset, an optimizer and a global batch size.

    ``committed_steps`` counts steps the scheduler has closed; ``version`` counts
    steps every aggregator has applied (the newest parameters agents can fetch).
    Between the two lies at most the staleness window.
    """

    class State(models.TextChoices):
        DRAFT = "draft"
        RUNNING = "running"
        PAUSED = "paused"
        FINISHED = "finished"

    name = models.CharField(max_length=200)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="campaigns")
    dataset = models.ForeignKey(Dataset, on_delete=models.PROTECT, related_name="campaigns")
    architecture = models.CharField(max_length=64)
    model_config = models.JSONField(default=dict)
    optimizer = models.JSONField(default=default_optimizer)
    seed = models.BigIntegerField(default=0)
    target_batch_size = models.PositiveIntegerField(default=256)
    microbatch_size = models.PositiveIntegerField(default=16)
    codec = models.CharField(max_length=16, default="fp32")
    staleness = models.PositiveSmallIntegerField(default=1, help_text="0 = fully synchronous")
    num_aggregators = models.PositiveSmallIntegerField(default=1)
    checkpoint_every = models.PositiveIntegerField(default=10)
    max_steps = models.PositiveIntegerField(null=True, blank=True)
    # A stranger's finite but huge gradient (say 3e38 everywhere) would still wreck the weights:
    # uploads whose norm per sample is over this are refused. 0 disables the check.
    max_grad_norm = models.FloatField(default=1e4, help_text="per-sample gradient norm bound; 0 disables")
    param_count = models.BigIntegerField(default=0, editable=False)
    state = models.CharField(max_length=16, choices=State.choices, default=State.DRAFT)
    committed_steps = models.PositiveIntegerField(default=0)
    version = models.PositiveIntegerField(default=0)
    epoch = models.PositiveIntegerField(default=0)
    cursor = models.BigIntegerField(default=0, help_text="next never-leased sample of the epoch")
    created_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return self.name

    @property
    def open_step(self) -> int:
        return self.committed_steps


class Step(models.Model):
    """A committed global step: exactly the leases whose ``step`` points here."""

    campaign = models.ForeignKey(Campaign, on_delete=models.CASCADE, related_name="steps")
    index = models.PositiveIntegerField()
    num_samples = models.PositiveIntegerField()
    loss_sum = models.FloatField()
    committed_at = models.DateTimeField(default=timezone.now)
    applied_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["campaign", "index"]
        constraints = [models.UniqueConstraint(fields=["campaign", "index"], name="unique_step_index")]

    def __str__(self) -> str:
        return f"{self.campaign} step {self.index}"

    @property
    def loss(self) -> float:
        return self.loss_sum / self.num_samples if self.num_samples else float("nan")
