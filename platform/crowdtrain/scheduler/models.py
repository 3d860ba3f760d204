from __future__ import annotations

from typing import Any

from django.db import models
from django.utils import timezone

from crowdtrain.accounts.models import Device
from crowdtrain.accounts.tokens import hash_token
from crowdtrain.campaigns.models import Campaign, Step


class Lease(models.Model):
    """One assignment of sample ranges to one agent, with a deadline.

    ``ranges`` is a list of ``[epoch, shard_index, start, count]``. A lease
    reserves its samples in ``target_step`` when it is issued, so a fast agent
    never pushes a slower one's work out of the staleness window. It is
    *active* until its agent reports it; *accepted* leases wait (``step``
    null) until their step is full, then point at the committed Step.
    """

    class State(models.TextChoices):
        ACTIVE = "active"
        ACCEPTED = "accepted"
        EXPIRED = "expired"
        RELEASED = "released"
        REJECTED = "rejected"

    campaign = models.ForeignKey(Campaign, on_delete=models.CASCADE, related_name="leases")
    # Indexed with its id below (device, id), which serves every lookup by device as well.
    device = models.ForeignKey(Device, on_delete=models.CASCADE, related_name="leases", db_index=False)
    base_version = models.PositiveIntegerField()
    target_step = models.PositiveIntegerField(default=0, help_text="the step this lease's samples are reserved in")
    ranges = models.JSONField()
    # The epoch of its first range: rebuilding the scheduler's hot state reads one epoch's leases, not all.
    epoch = models.PositiveIntegerField(default=0)
    num_samples = models.PositiveIntegerField()
    state = models.CharField(max_length=16, choices=State.choices, default=State.ACTIVE, db_index=True)
    issued_at = models.DateTimeField(default=timezone.now)
    deadline = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)
    step = models.ForeignKey(Step, on_delete=models.SET_NULL, null=True, blank=True, related_name="leases")
    loss_sum = models.FloatField(null=True, blank=True)
    compute_s = models.FloatField(null=True, blank=True)
    reason = models.CharField(max_length=200, blank=True)
    request_id = models.CharField(max_length=64, blank=True, help_text="the agent's id for the request that got it")

    class Meta:
        ordering = ["id"]
        indexes = [
            models.Index(fields=["campaign", "state"]),
            models.Index(fields=["campaign", "epoch"]),
            # My devices reads each device's newest leases: an index scan of a few rows, however many it has.
            models.Index(fields=["device", "id"], name="lease_device_newest"),
        ]

    def __str__(self) -> str:
        return f"lease {self.pk} ({self.state})"

    def save(self, *args: Any, **kwargs: Any) -> None:
        # Ids come from the scheduler's blocks (ids.py), never the table's own sequence, which never
        # sees them: a row saved without one (admin, shell, tests) takes the next id of a block too.
        if self.pk is None:
            from .ids import lease_ids

            self.pk = lease_ids.take()
        super().save(*args, **kwargs)


class IdBlock(models.Model):
    """The next free id of a sequence that site processes take from in blocks (lease ids).

    Lease ids are chosen when the lease is decided in Redis, before its row is
    written; each process reserves a block here, so ids never repeat across
    processes, restarts or a Redis that lost its keys.
    """

    name = models.CharField(max_length=32, primary_key=True)
    next_id = models.BigIntegerField()


class Aggregator(models.Model):
    """A backbone node; it authenticates with its own token and owns parameter slices."""

    name = models.CharField(max_length=100, unique=True)
    token_hash = models.CharField(max_length=64, unique=True, editable=False)
    upload_url = models.CharField(max_length=300, blank=True)
    params_url = models.CharField(max_length=300, blank=True)
    connected = models.BooleanField(default=False)
    # The channel name of the site socket that speaks for the aggregator now: only that socket's
    # close marks its slices not ready (a replaced, older socket may close after the newer one joined).
    channel_name = models.CharField(max_length=200, blank=True, default="", editable=False)
    last_seen_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    @classmethod
    def authenticate(cls, token: str | None) -> Aggregator | None:
        """The aggregator whose backbone token this is (tokens are kept hashed), or None."""
        if not token:
            return None
        return cls.objects.filter(token_hash=hash_token(token)).first()

    def __str__(self) -> str:
        return self.name


class SliceAssignment(models.Model):
    """Elements ``start:end`` of a campaign's flat parameters live on one aggregator."""

    campaign = models.ForeignKey(Campaign, on_delete=models.CASCADE, related_name="slices")
    aggregator = models.ForeignKey(Aggregator, on_delete=models.CASCADE, related_name="slices")
    index = models.PositiveSmallIntegerField()
    start = models.BigIntegerField()
    end = models.BigIntegerField()
    ready = models.BooleanField(default=False)
    version = models.PositiveIntegerField(default=0, help_text="newest version this slice has applied")

    class Meta:
        ordering = ["campaign", "index"]
        constraints = [models.UniqueConstraint(fields=["campaign", "index"], name="unique_slice_index")]


class Checkpoint(models.Model):
    """An aggregator confirmed the checkpoint of one slice at one version (it is in checkpoint storage).

    A version is *complete* when every slice of the campaign has one: only
    complete versions are restore and rollback targets, so no slice is ever
    asked for a version it lacks.
    """

    campaign = models.ForeignKey(Campaign, on_delete=models.CASCADE, related_name="checkpoints")
    slice_index = models.PositiveSmallIntegerField()
    version = models.PositiveIntegerField()
    aggregator = models.ForeignKey(Aggregator, on_delete=models.SET_NULL, null=True, related_name="checkpoints")
    saved_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["campaign", "version", "slice_index"]
        constraints = [
            models.UniqueConstraint(fields=["campaign", "slice_index", "version"], name="unique_slice_checkpoint")
        ]

    def __str__(self) -> str:
        return f"campaign {self.campaign_id} slice {self.slice_index} v{self.version}"


class StepNetwork(models.Model):
    """What a committed step cost the volunteers' links, summed from its leases' done reports (protocol 2.3).

    Written with the step, in its transaction (``commits``), and gone with it
    when a rollback forgets the step. ``samples`` are those of leases whose
    agent stated its traffic; the figures (bytes, seconds) are theirs alone.
    ``unreported_samples`` came from older agents that state nothing: unknown,
    not free. ``compute_s`` is the reporting leases' compute time, so that
    ``network_s / (network_s + compute_s)`` is the share of their time the
    network took.
    """

    step = models.OneToOneField(Step, on_delete=models.CASCADE, primary_key=True, related_name="network")
    # The campaign's own key (a step's is one join away): the whole run's totals are one indexed sum.
    campaign = models.ForeignKey(Campaign, on_delete=models.CASCADE, related_name="step_network")
    samples = models.PositiveIntegerField(default=0)
    unreported_samples = models.PositiveIntegerField(default=0)
    bytes_up = models.BigIntegerField(default=0)
    bytes_down = models.BigIntegerField(default=0)
    network_s = models.FloatField(default=0.0)
    compute_s = models.FloatField(default=0.0)

    def __str__(self) -> str:
        return f"network cost of {self.step}"
