"""The aggregator's Prometheus metrics, served on its HTTP port at ``/metrics`` (see ``http_routes``).

One registry per node, not prometheus_client's global one: tests run several
aggregators in one process, and each must count only its own uploads. Gauges
are read from the node when scraped; counters and the apply histogram are
changed where uploads end and steps are applied, with no I/O.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .node import AggregatorNode

# Applying a step is an optimizer pass over the slice: milliseconds for small slices, seconds for large ones.
APPLY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _NodeCollector(Collector):
    """What the node holds now: pending bytes, and per slice its version, versions kept, leases and clips."""

    def __init__(self, node: AggregatorNode) -> None:
        self.node = node

    def collect(self) -> Iterator[Metric]:
        node = self.node
        yield GaugeMetricFamily(
            "crowdtrain_backbone_pending_bytes", "Gradient bytes held for steps not yet applied", value=node.budget.used
        )
        yield GaugeMetricFamily(
            "crowdtrain_backbone_pending_bytes_limit", "The cap on pending bytes (--max-pending-bytes)",
            value=node.budget.limit,
        )  # fmt: skip
        labels = ["campaign", "slice"]
        version = GaugeMetricFamily("crowdtrain_backbone_slice_version", "Newest version of the slice", labels=labels)
        held = GaugeMetricFamily("crowdtrain_backbone_versions_held", "Versions kept for downloads", labels=labels)
        pending = GaugeMetricFamily(
            "crowdtrain_backbone_pending_leases", "Uploads waiting for their step", labels=labels
        )
        owed = GaugeMetricFamily(
            "crowdtrain_backbone_checkpoint_owed",
            "1 while the slice's last checkpoint was refused by the store and not yet written again",
            labels=labels,
        )
        clipped = CounterMetricFamily(
            "crowdtrain_backbone_clipped_contributions",
            "Contributions whose norm was clipped since this process took the slice",
            labels=labels,
        )
        for state in list(node.slices.values()):
            key = [str(state.campaign_id), str(state.slice_index)]
            version.add_metric(key, state.version)
            held.add_metric(key, len(state.snapshots))
            pending.add_metric(key, len(state.pending))
            clipped.add_metric(key, state.clipped)
            owed.add_metric(key, int((state.campaign_id, state.slice_index) in node.owed))
        yield from (version, held, pending, clipped, owed)

    def describe(self) -> list[Any]:
        return []


class BackboneMetrics:
    """The node's registry and the counters its upload and step code changes."""

    def __init__(self, node: AggregatorNode) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.uploads = Counter(
            "crowdtrain_backbone_uploads",
            "Gradient uploads by result (accepted, rejected) and rejection code",
            ["result", "code"],
            registry=self.registry,
        )
        self.ingest_bytes = Counter(
            "crowdtrain_backbone_ingest_bytes", "Wire bytes of accepted gradient uploads", registry=self.registry
        )
        self.steps_applied = Counter(
            "crowdtrain_backbone_steps_applied", "Steps applied", ["campaign", "slice"], registry=self.registry
        )
        self.checkpoint_failures = Counter(
            "crowdtrain_backbone_checkpoint_failures",
            "Checkpoints the store refused (storage down, disk full); each slice is written again until it takes one",
            ["campaign", "slice"],
            registry=self.registry,
        )
        self.apply_seconds = Histogram(
            "crowdtrain_backbone_apply_seconds",
            "Time to apply one step to one slice (the optimizer pass, off the event loop)",
            buckets=APPLY_BUCKETS,
            registry=self.registry,
        )
        # process_resident_memory_bytes and CPU seconds, read from /proc at scrape time.
        ProcessCollector(registry=self.registry)
        self.registry.register(_NodeCollector(node))

    def upload_accepted(self, wire_bytes: int) -> None:
        self.uploads.labels("accepted", "").inc()
        self.ingest_bytes.inc(wire_bytes)

    def upload_rejected(self, code: str) -> None:
        self.uploads.labels("rejected", code).inc()

    def step_applied(self, campaign_id: int, slice_index: int, seconds: float) -> None:
        self.steps_applied.labels(str(campaign_id), str(slice_index)).inc()
        self.apply_seconds.observe(seconds)

    def checkpoint_failed(self, campaign_id: int, slice_index: int) -> None:
        self.checkpoint_failures.labels(str(campaign_id), str(slice_index)).inc()

    def render(self) -> bytes:
        """The exposition text of one scrape."""
        return generate_latest(self.registry)
