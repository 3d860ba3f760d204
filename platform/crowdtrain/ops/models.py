"""The admin dashboard's history: one small row per minute, so a week of charts is a bounded read."""

from __future__ import annotations

from django.db import models

SITE = "site"  # the source of the swarm-wide row of a minute (agents online, campaign steps and losses)


class DashboardSample(models.Model):
    """What one minute looked like, from one source.

    ``source`` is ``"site"`` for the swarm-wide figures (the first site
    process to write a minute wins; the others skip it), or
    ``"process:<host>:<pid>"`` for the lease outcomes one site process
    counted in that minute: those counters live in each process's memory
    (``lib.metrics``), and the dashboard sums the processes' rows.
    """

    minute = models.DateTimeField(help_text="the minute's start (UTC)")
    source = models.CharField(max_length=100)
    data = models.JSONField()

    objects: models.Manager[DashboardSample] = models.Manager()

    class Meta:
        ordering = ["minute", "source"]
        constraints = [models.UniqueConstraint(fields=["minute", "source"], name="unique_dashboard_sample")]
        indexes = [models.Index(fields=["minute"])]

    def __str__(self) -> str:
        return f"{self.source} {self.minute:%Y-%m-%d %H:%M}"
