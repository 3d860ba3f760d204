"""Read the site's /metrics through the Django test client, as Prometheus would."""

from __future__ import annotations

from django.test import Client
from prometheus_client.parser import text_string_to_metric_families


def scrape(client: Client, **headers: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of one scrape, keyed by (sample name, sorted labels)."""
    response = client.get("/metrics", **headers)
    assert response.status_code == 200, response.content[:500]
    samples = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))
