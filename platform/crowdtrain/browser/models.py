"""The verdict on a model's gradient graphs: one row per model, config and microbatch size, shared by campaigns."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from django.db import models
from django.utils import timezone


def config_sha256(model_config: Any) -> str:
    """The SHA-256 of a model config's canonical JSON (sorted keys, no spaces): part of a graph's key.

    The config as the campaign holds it, not with the registry's defaults filled in: the lease path
    computes this key and must not load the model registry (torch) to do it. Two spellings of one
    config get two rows, which costs an export, never a wrong graph.
    """
    text = json.dumps(model_config, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def graph_storage_name(sha256: str) -> str:
    return f"browser-graphs/{sha256}.onnx"


class BrowserGraph(models.Model):
    """Whether browser tabs may compute a model's gradients, and the graphs they run.

    Content-addressed: campaigns with the same model, config and microbatch size
    share one row and one export. Two graphs are gated: one for the microbatch
    size and, when that is above 1, one for a single sample, which a tab runs
    once per sample of a lease's last, partial microbatch. The row passes only
    when both do. A third, optional graph runs several microbatches at once
    (``wide_size`` samples) for a model whose samples do not meet in a batch;
    it is offered only when it computes what the microbatches sum to.
    """

    class Status(models.TextChoices):
        PENDING = "pending"
        PASSED = "passed"
        REFUSED = "refused"

    model_name = models.CharField(max_length=64)
    config_sha256 = models.CharField(max_length=64)
    model_config = models.JSONField(default=dict)  # what config_sha256 is of: the worker exports from it
    microbatch_size = models.PositiveIntegerField()
    status = models.CharField(max_length=8, choices=Status.choices, default=Status.PENDING)
    # Words for the organizer: why browsers are not offered the work, or the gate's figures when they are.
    reason = models.TextField(blank=True, default="")
    sha256 = models.CharField(max_length=64, blank=True, default="")  # the graph for microbatch_size samples
    sha256_one = models.CharField(max_length=64, blank=True, default="")  # batch 1; blank when microbatch_size is 1
    bytes = models.BigIntegerField(default=0)  # of the microbatch graph
    bytes_one = models.BigIntegerField(default=0)
    wide_size = models.PositiveIntegerField(default=0)  # samples per run of the wide graph; 0: none offered
    sha256_wide = models.CharField(max_length=64, blank=True, default="")
    bytes_wide = models.BigIntegerField(default=0)
    manifest = models.JSONField(default=dict, blank=True)  # GraphManifest.to_dict() of the microbatch graph
    # The gate's figures, of the worse of the two graphs (the larger ratio): errors against fp64.
    graph_error = models.FloatField(null=True, blank=True)
    torch_error = models.FloatField(null=True, blank=True)
    ratio = models.FloatField(null=True, blank=True)  # graph_error / torch_error; null when not measured
    seconds = models.FloatField(null=True, blank=True)  # export and gate of both graphs
    # What a tab needs to hold its graphs, the parameters, gradients and activations (``memory``).
    memory_bytes = models.BigIntegerField(default=0)
    # When a worker took the row; a pending row taken longer ago than CROWDTRAIN_BROWSER_GRAPH_TIMEOUT_S
    # (its worker died) may be taken again.
    started_at = models.DateTimeField(null=True, blank=True)
    checked_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["model_name", "config_sha256", "microbatch_size"], name="browser_graph_key")
        ]

    def __str__(self) -> str:
        return f"{self.model_name} {self.config_sha256[:12]} x{self.microbatch_size}: {self.status}"
