"""What the Prometheus tests share: Debian's binaries, deploy/'s files, the queries of the alerts and the dashboard."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml  # PyYAML comes with moto (the test extra); Prometheus's files are YAML

from crowdtrain_launcher import REPO_ROOT

# Debian's prometheus package (`make prometheus`, a prerequisite of `make test`) puts both here.
PROMETHEUS = Path("/usr/bin/prometheus")
PROMTOOL = Path("/usr/bin/promtool")

SCRAPE_CONFIG = REPO_ROOT / "deploy" / "prometheus" / "prometheus.yml"
ALERT_RULES = REPO_ROOT / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "crowdtrain.json"
# Where compose mounts deploy/metrics_token; the tests point the config at a file of their own.
COMPOSE_TOKEN_FILE = "/etc/prometheus/metrics_token"

# Grafana fills these in before a query reaches Prometheus: values it would pick for a 6 h dashboard.
GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "$__interval": "15s",
    "$__range": "6h",
    "$__range_s": "21600",
}

# Words of PromQL that are not metric names (function names are told by the "(" after them).
_KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_NAME = re.compile(r"(?<![\w.$])[A-Za-z_:][A-Za-z0-9_:]*")
# A histogram or summary is one family in the metadata and several series names in the data.
_SERIES_SUFFIXES = ("_bucket", "_sum", "_count")


def binary(path: Path) -> str:
    """``path`` if Debian's prometheus package installed it; fails the test (never skips) when it is missing."""
    if not os.access(path, os.X_OK):
        pytest.fail(
            f"{path} is missing: the deploy tests run Debian's Prometheus; "
            "`make prometheus` installs it (apt-get install -y --no-install-recommends prometheus)"
        )
    return str(path)


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def alert_rules() -> dict[str, dict[str, Any]]:
    """Every alerting rule of deploy/prometheus/alerts.yml by name."""
    return {
        rule["alert"]: rule for group in load_yaml(ALERT_RULES)["groups"] for rule in group["rules"] if "alert" in rule
    }


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel of the Grafana dashboard, rows' panels included."""
    queries: list[tuple[str, str]] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            for target in panel.get("targets", []):
                if target.get("expr"):
                    queries.append((panel.get("title", "?"), target["expr"]))
            walk(panel.get("panels", []))

    dashboard = json.loads(DASHBOARD.read_text())
    walk(dashboard["panels"])
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":  # label_values(...) queries are Grafana's, not PromQL
            raise AssertionError(
                f"the dashboard's variable {variable['name']!r} needs a case in tests/deploy/promql.py"
            )
    return queries


def as_prometheus_sees_it(expr: str) -> str:
    """A Grafana query with Grafana's variables filled in; an unknown variable fails with its name."""
    for variable in sorted(GRAFANA_VARIABLES, key=len, reverse=True):  # $__range_s before $__range
        expr = expr.replace(variable, GRAFANA_VARIABLES[variable])
    unknown = re.findall(r"\$\{?\w+", expr)
    if unknown:
        raise AssertionError(f"{expr!r} uses Grafana variables {unknown} that tests/deploy/promql.py does not fill in")
    return expr


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (not its functions, keywords, labels or durations)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges and subqueries
    text = _GROUPING.sub(" ", text)
    names = set()
    for match in _NAME.finditer(text):
        word = match.group(0)
        if word.lower() in _KEYWORDS or text[match.end() :].lstrip().startswith("("):
            continue
        names.add(word)
    return names


def family_of(name: str) -> str:
    """The metadata family of a series name (``x_bucket`` -> ``x``); counters keep ``_total`` in text format."""
    for suffix in _SERIES_SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name
