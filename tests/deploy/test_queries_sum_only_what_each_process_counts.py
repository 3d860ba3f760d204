"""The dashboard and the alerts sum over site processes only what each process counts itself.

Every site process is scraped on its own (deploy/prometheus/prometheus.yml). What
``crowdtrain.lib.metrics`` counts lives in one process's memory, and the processes'
numbers add up; what ``crowdtrain.ops.collectors`` reads from PostgreSQL and Redis is
the same number on every process, and a ``sum`` would count it once per process: such
a panel doubled with compose's two replicas.
"""

from __future__ import annotations

import re

from prometheus_client.metrics import MetricWrapperBase

from crowdtrain.lib import metrics

from .promql import alert_rules, dashboard_queries, family_of, metric_names

PER_PROCESS = {
    family.name
    for value in vars(metrics).values()
    if isinstance(value, MetricWrapperBase)
    for family in value.describe()
}


def shared(name: str) -> bool:
    """Whether every site process exports the same value (read from the database or Redis)."""
    if not name.startswith("crowdtrain_") or name.startswith("crowdtrain_backbone_"):
        return False  # Prometheus's own (up), or an aggregator's: each aggregator counts its own
    return family_of(name).removesuffix("_total") not in PER_PROCESS


def test_no_query_sums_a_number_every_site_process_reads_from_the_database() -> None:
    queries = [(f"alert {name}", rule["expr"]) for name, rule in alert_rules().items()]
    queries += [(f"panel {title!r}", expr) for title, expr in dashboard_queries()]

    summed = [
        (where, sorted(filter(shared, metric_names(expr)))) for where, expr in queries if re.search(r"\bsum\b", expr)
    ]

    assert {"crowdtrain_lease_outcomes", "crowdtrain_lease_request_seconds"} <= PER_PROCESS
    assert [(where, names) for where, names in summed if names] == [], "take max of these, not sum"
