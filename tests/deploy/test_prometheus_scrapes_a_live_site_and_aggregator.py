"""Debian's Prometheus, with deploy/'s scrape jobs and alert rules, scrapes a live site and aggregator while an
agent trains: what it reads is the database's, every rule loads and agrees with /healthz, and every query of
the alerts and of the Grafana dashboard runs and names only metrics the programs export.

One run for all of it: starting the site, an aggregator and an agent is the slow part.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from crowdtrain_launcher import Child, Site, Swarm
from crowdtrain_launcher.engines import free_port
from tests.e2e.conftest import Run, seed, service_database

from .promql import (
    ALERT_RULES,
    PROMETHEUS,
    SCRAPE_CONFIG,
    alert_rules,
    as_prometheus_sees_it,
    binary,
    dashboard_queries,
    family_of,
    load_yaml,
    metric_names,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

TOKEN = "prometheus-test-token"
REDIS_PREFIX = "ct-prometheus-test-{pid}"
PROMETHEUS_READY = re.compile(r"Server is ready to receive web requests")
SPEC = {
    "campaigns": [{
        "name": "tiny GPT", "architecture": "gpt",
        "model_config": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32},
        "dataset": {"kind": "stdlib", "bytes": 512 << 10, "sample_len": 33, "shard_bytes": 64 << 10},
        "optimizer": {"name": "adamw", "lr": 1e-2}, "target_batch_size": 64, "microbatch_size": 16,
        "staleness": 1, "max_steps": 1000, "seed": 7, "check_fraction": 0.0,
    }],
    # agg-spare has a token but never starts: it holds no slices, so nothing may call it silent.
    "aggregators": ["agg-1", "agg-spare"],
    "agents": ["agent-1"],
}  # fmt: skip
SITE_ENV = {"CROWDTRAIN_LEASE_TARGET_S": "0.3", "CROWDTRAIN_MAX_LEASE_SAMPLES": "32"}
STEPS = 2
# What the database says, read back through manage.py as the end-to-end tests do (the site owns the database).
DATABASE_SNAPSHOT = """
import json
from django.db.models import Count, Sum
from crowdtrain.accounts.models import Device
from crowdtrain.campaigns.models import Campaign, Step
from crowdtrain.scheduler.models import Aggregator, Lease
campaign = Campaign.objects.get(pk={campaign_id})
by_state = lambda rows: dict(rows.values_list("state").annotate(n=Count("id")).values_list("state", "n"))
print(json.dumps({{
    "campaigns": by_state(Campaign.objects), "campaign_states": list(Campaign.State.values),
    "committed_steps": campaign.committed_steps,
    "samples": Step.objects.filter(campaign=campaign).aggregate(n=Sum("num_samples"))["n"],
    "leases": by_state(Lease.objects.filter(campaign=campaign)),
    "connected": sorted(Aggregator.objects.filter(connected=True).values_list("name", flat=True)),
    "cpu_devices": Device.objects.filter(hardware__kind="cpu").count(),
}}))
"""


@dataclass(frozen=True)
class Prometheus:
    """The HTTP API of one running Prometheus."""

    url: str
    child: Child

    def api(self, path: str, **params: str) -> Any:
        """The ``data`` of a successful answer; an error answer (HTTP 400 for a bad query) raises with its message."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 (loopback http only)
                body = json.loads(response.read())
        except urllib.error.HTTPError as error:
            body = json.loads(error.read() or b"{}")
        if body.get("status") != "success":
            raise QueryError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return list(self.api("query", query=expr)["result"])

    def values(self, expr: str, label: str) -> dict[str, float]:
        """An instant vector's values by one of its labels."""
        return {row["metric"].get(label, ""): float(row["value"][1]) for row in self.query(expr)}

    def targets(self) -> dict[str, str]:
        """Each job's target's health, and the error of its last scrape if it failed."""
        return {t["labels"]["job"]: t["health"] + t["lastError"] for t in self.api("targets")["activeTargets"]}

    def value(self, expr: str) -> float | None:
        rows = self.query(expr)
        return float(rows[0]["value"][1]) if len(rows) == 1 else None


class QueryError(AssertionError):
    """Prometheus refused a request or a query."""


def eventually(
    read: Callable[[], Any], expected: Any, what: str, timeout_s: float = 8.0, context: Callable[[], Any] = str
) -> None:
    """Poll ``read()`` until it returns ``expected`` (Prometheus scrapes every 2 s); ``context()`` explains."""
    deadline = time.monotonic() + timeout_s
    while (got := read()) != expected:
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: Prometheus says {got!r}, expected {expected!r} {context()}")
        time.sleep(0.25)


def scrape_config(site: Site, aggregator_url: str, token_file: Path) -> dict[str, Any]:
    """deploy/'s scrape jobs, on these two targets, every 2 s, with the token in ``token_file``."""
    config = load_yaml(SCRAPE_CONFIG)
    targets = {
        "crowdtrain-site": urllib.parse.urlsplit(site.url).netloc,
        "crowdtrain-aggregator": urllib.parse.urlsplit(aggregator_url).netloc,
    }
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    assert jobs == {*targets, "crowdtrain-committer"}, "deploy/'s jobs were renamed"
    # The embedded default this runs on has no Redis, so no committer: its /metrics is tested on its own
    # (tests/web/ops) and in the balancer's end-to-end test, which runs one.
    config["scrape_configs"] = [job for job in config["scrape_configs"] if job["job_name"] in targets]
    for job in config["scrape_configs"]:
        for key in [k for k in job if k.endswith("_sd_configs") or k == "static_configs"]:
            del job[key]  # Docker's DNS names: here each job has one target on loopback
        job["static_configs"] = [{"targets": [targets[job["job_name"]]]}]
        job["authorization"]["credentials_file"] = str(token_file)
    # A scrape may take longer than a second on two busy cores; a timed-out one reads as a target down.
    config["global"] = {"scrape_interval": "2s", "scrape_timeout": "2s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(ALERT_RULES)]
    return dict(config)


def start_prometheus(swarm: Swarm, folder: Path, config: dict[str, Any]) -> Prometheus:
    folder.mkdir(parents=True)
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    argv = [
        binary(PROMETHEUS),
        f"--config.file={folder / 'prometheus.yml'}",
        f"--storage.tsdb.path={folder / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    return Prometheus(f"http://127.0.0.1:{port}", swarm.start("prometheus", argv))


def healthz(site: Site) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"{site.url}/healthz", timeout=10) as response:  # noqa: S310
            return dict(json.loads(response.read()))
    except urllib.error.HTTPError as error:  # 503 while a critical alert fires; the body says which
        return dict(json.loads(error.read()))


def test_prometheus_reads_the_database_and_runs_every_alert_and_dashboard_query(tmp_path: Path) -> None:
    binary(PROMETHEUS)  # before anything starts: a missing Prometheus fails at once
    token_file = tmp_path / "metrics_token"
    token_file.write_text(TOKEN + "\n")
    env = {
        "CROWDTRAIN_VAR_DIR": str(tmp_path / "run" / "var"),
        "CROWDTRAIN_METRICS_TOKEN": TOKEN,
        "CROWDTRAIN_BACKBONE_METRICS_TOKEN": TOKEN,
        # Its own keys in a shared Redis: another run's aggregator 2 or device 1 must not count as this one's.
        "CROWDTRAIN_REDIS_PREFIX": REDIS_PREFIX.format(pid=os.getpid()),
    }
    with service_database() as services:
        swarm = Swarm(tmp_path / "run", env={**env, **services})
        try:
            # Start: the site, one of the two aggregators, then Prometheus and the agent together.
            run = Run(swarm, seed(swarm, SPEC, tmp_path / "spec.json"))
            run.site = site = swarm.start_site(env=SITE_ENV)
            [aggregator_url] = swarm.start_aggregators(site, {"agg-1": run.seed["aggregators"]["agg-1"]})
            prometheus = start_prometheus(
                swarm, tmp_path / "prometheus", scrape_config(site, aggregator_url, token_file)
            )
            agent = swarm.start_agent(site, token=run.seed["agents"]["agent-1"], campaign_id=run.campaign_id)
            prometheus.child.wait_for_line(PROMETHEUS_READY, timeout_s=30)
            run.wait_for_version(STEPS, timeout_s=60)

            # While the agent trains: both targets up with the token, the agent counted online.
            eventually(prometheus.targets, {"crowdtrain-site": "up", "crowdtrain-aggregator": "up"}, "targets")
            eventually(lambda: prometheus.value("crowdtrain_agents_online"), 1.0, "agents online")
            eventually(lambda: prometheus.values("crowdtrain_agents_online_by_kind", "kind"), {"cpu": 1.0}, "by kind")

            # The agent leaves (handing its lease back): from now on the database stands still.
            agent.stop(grace_s=10.0)
            time.sleep(1.5)
            db = json.loads(swarm.manage("shell", "-c", DATABASE_SNAPSHOT.format(campaign_id=run.campaign_id))
                            .strip().splitlines()[-1])  # fmt: skip
            campaign = f'campaign="{run.campaign_id}"'

            assert db["cpu_devices"] == 1
            eventually(lambda: prometheus.values("crowdtrain_campaigns", "state"),
                       {state: float(db["campaigns"].get(state, 0)) for state in db["campaign_states"]},
                       "campaigns by state")  # fmt: skip
            eventually(lambda: prometheus.value(f"crowdtrain_campaign_committed_steps{{{campaign}}}"),
                       float(db["committed_steps"]), "committed steps")  # fmt: skip
            assert db["committed_steps"] >= STEPS
            eventually(lambda: prometheus.value(f"crowdtrain_campaign_samples_total{{{campaign}}}"),
                       float(db["samples"]), "samples")  # fmt: skip
            eventually(lambda: prometheus.value(f"crowdtrain_leases_active{{{campaign}}}"),
                       float(db["leases"].get("active", 0)), "active leases")  # fmt: skip
            ended = {state: float(n) for state, n in db["leases"].items() if state != "active"}
            eventually(lambda: prometheus.values(f"sum by (state) (crowdtrain_lease_outcomes_total{{{campaign}}})",
                                                 "state"), ended, "lease outcomes")  # fmt: skip
            eventually(lambda: prometheus.values("crowdtrain_aggregator_connected == 1", "aggregator"),
                       dict.fromkeys(db["connected"], 1.0), "connected aggregators")  # fmt: skip
            assert db["connected"] == ["agg-1"]
            eventually(lambda: prometheus.value("crowdtrain_backbone_steps_applied_total"),
                       float(db["committed_steps"]), "steps the aggregator applied")  # fmt: skip

            # Every rule group loads, and its rules evaluate without error.
            eventually(lambda: {(g["name"], r["name"]): (r["health"], r.get("lastError", ""))
                                for g in prometheus.api("rules")["groups"] for r in g["rules"]},
                       {(group["name"], rule["alert"]): ("ok", "")
                        for group in load_yaml(ALERT_RULES)["groups"] for rule in group["rules"]},
                       "rule health")  # fmt: skip

            # The rules say what /healthz says: here nothing (the spare aggregator holds no slices).
            site_codes = {alert["code"] for alert in healthz(site)["alerts"]}
            assert site_codes == set(), healthz(site)
            eventually(lambda: sorted((a["labels"]["alertname"], a["state"], a["labels"].get("aggregator", ""))
                                      for a in prometheus.api("alerts")["alerts"]),
                       [], "alerts pending or firing",
                       context=lambda: (prometheus.api("alerts"), prometheus.targets()))  # fmt: skip

            # Every query of the alerts and of the dashboard runs, on metrics the programs export. A metric
            # with no sample yet (no upload was rejected, no Celery task failed) is known by its HELP line.
            series = set(prometheus.api("label/__name__/values"))
            described = set(prometheus.api("metadata"))
            queries = [(f"alert {name}", rule["expr"]) for name, rule in alert_rules().items()]
            queries += [(f"panel {title!r}", as_prometheus_sees_it(expr)) for title, expr in dashboard_queries()]
            problems = []
            for where, expr in queries:
                try:
                    prometheus.query(expr)
                except QueryError as error:
                    problems.append(f"{where}: {expr!r} is refused: {error}")
                unknown = {n for n in metric_names(expr) if n not in series and family_of(n) not in described}
                if unknown:
                    problems.append(f"{where}: {expr!r} reads {sorted(unknown)}, which nothing exports")
            assert len(queries) > 20
            assert not problems, "\n".join(problems)
        finally:
            swarm.stop(grace_s=5.0)
            if services.get("REDIS_URL"):
                forget_keys(services["REDIS_URL"], env["CROWDTRAIN_REDIS_PREFIX"])


def forget_keys(redis_url: str, prefix: str) -> None:
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        client.delete(*keys)
