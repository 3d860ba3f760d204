"""Each connected aggregator's own figures (memory, pending bytes, ingest MB/s, versions held), read from its /metrics.

The site's heartbeat from an aggregator carries nothing but "alive", and the
protocol stays as it is: the dashboard reads the aggregator's Prometheus
endpoint on its HTTP port (the host of its ``params_url``), with a short
timeout and in parallel, at most once per ``CACHE_S`` per process whatever the
number of watchers. Ingest MB/s is the growth of its ingest counter between
two reads. An aggregator that does not answer shows its error instead.
Reads go through the agent's pooled client (``crowdtrain_agent.pooled_http``):
a dashboard refreshed every few seconds reuses its connection to each aggregator.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from prometheus_client.parser import text_string_to_metric_families

from crowdtrain_agent import pooled_http

logger = logging.getLogger(__name__)

TIMEOUT_S = 1.0
CACHE_S = 2.0


@dataclass
class _Reading:
    at: float
    figures: dict[str, Any]
    ingest_bytes: float | None = None
    error: str = ""
    rates: dict[str, float] = field(default_factory=dict)


def metrics_url(params_url: str) -> str | None:
    """``http://host:port/metrics`` of the aggregator whose parameters are served at ``params_url``."""
    parts = urlsplit(params_url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return None
    return f"{parts.scheme}://{parts.netloc}/metrics"


def parse(text: str) -> tuple[dict[str, Any], float | None]:
    """The dashboard's figures from one scrape, and the ingest byte counter."""
    figures: dict[str, Any] = {"memory_bytes": None, "pending_bytes": None, "pending_bytes_limit": None,
                               "versions_held": {}, "slice_versions": {}}  # fmt: skip
    ingest: float | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, sample.value
            key = f"{labels.get('campaign', '')}/{labels.get('slice', '')}"
            if name == "process_resident_memory_bytes":
                figures["memory_bytes"] = value
            elif name == "crowdtrain_backbone_pending_bytes":
                figures["pending_bytes"] = value
            elif name == "crowdtrain_backbone_pending_bytes_limit":
                figures["pending_bytes_limit"] = value
            elif name == "crowdtrain_backbone_versions_held":
                figures["versions_held"][key] = int(value)
            elif name == "crowdtrain_backbone_slice_version":
                figures["slice_versions"][key] = int(value)
            elif name == "crowdtrain_backbone_ingest_bytes_total":
                ingest = value
    return figures, ingest


class AggregatorProbe:
    """The last reading of each aggregator, and the rate between the last two."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._readings: dict[int, _Reading] = {}

    def _read(self, url: str) -> tuple[dict[str, Any], float | None]:
        headers = {"User-Agent": "crowdtrain-site"}
        if settings.CROWDTRAIN_METRICS_TOKEN:  # deploy/ gives site and aggregators the same scrape token
            headers["Authorization"] = f"Bearer {settings.CROWDTRAIN_METRICS_TOKEN}"
        with pooled_http.get(url, headers, TIMEOUT_S) as response:  # http(s) only: metrics_url
            if not 200 <= response.status < 300:  # worded as urllib's HTTPError, which the dashboard showed
                raise OSError(f"HTTP Error {response.status}: {response.reason}")
            return parse(response.read().decode("utf-8", "replace"))

    def _refresh(self, aggregator_id: int, url: str | None) -> _Reading:
        now = time.monotonic()
        with self._lock:
            previous = self._readings.get(aggregator_id)
        if previous is not None and now - previous.at < CACHE_S:
            return previous
        if url is None:
            reading = _Reading(now, {}, error="it announced no HTTP address")
        else:
            try:
                figures, ingest = self._read(url)
                reading = _Reading(now, figures, ingest)
            except (OSError, ValueError) as exc:
                logger.debug("aggregator %s: cannot read %s: %s", aggregator_id, url, exc)
                reading = _Reading(now, {}, error=f"its /metrics did not answer ({exc})"[:200])
        if previous is not None and previous.ingest_bytes is not None and reading.ingest_bytes is not None:
            span = reading.at - previous.at
            if span > 0:
                reading.rates["ingest_mb_s"] = max(0.0, reading.ingest_bytes - previous.ingest_bytes) / span / 1e6
        elif previous is not None and "ingest_mb_s" in previous.rates and not reading.error:
            reading.rates["ingest_mb_s"] = previous.rates["ingest_mb_s"]
        with self._lock:
            self._readings[aggregator_id] = reading
        return reading

    def read_all(self, aggregators: list[tuple[int, str]]) -> dict[int, dict[str, Any]]:
        """For each (id, params_url) of a connected aggregator: its figures, ``ingest_mb_s`` and ``error``."""
        if not aggregators:
            return {}
        with ThreadPoolExecutor(max_workers=min(8, len(aggregators))) as pool:
            readings = list(pool.map(lambda a: self._refresh(a[0], metrics_url(a[1])), aggregators))
        return {
            aggregator_id: {**r.figures, "ingest_mb_s": r.rates.get("ingest_mb_s"), "error": r.error}
            for (aggregator_id, _), r in zip(aggregators, readings, strict=True)
        }


probe = AggregatorProbe()
