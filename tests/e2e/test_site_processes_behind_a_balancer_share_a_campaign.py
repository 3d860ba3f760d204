"""The production topology on loopback: two daphne processes behind HAProxy train a campaign, and survive losing one.

``crowdtrain_launcher.cluster`` starts what ``make cluster`` starts, at small scale: HAProxy
ending TLS in front of two site processes with production settings, on this
machine's PostgreSQL (a database of the test's own) and Redis, a committer, one
Celery worker, beat and one aggregator. Two agents and the aggregator reach the site
only through the balancer's address. Needs haproxy: ``make test`` installs it.

The committer writes the first steps and is then killed outright, with the busiest
site process stopped at the same moment: the sites write the rest themselves.
"""

from __future__ import annotations

import json
import os
import re
import signal
import ssl
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from crowdtrain_launcher import engines
from crowdtrain_launcher.cluster import Cluster
from tests.e2e.datasets import write_projection_dataset
from tests.e2e.test_swarm_trains_a_gpt import counted_samples
from tests.services import DEFAULT_DATABASE_URL, DEFAULT_REDIS_URL

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

STEPS = 60
STOP_AT_VERSION = 2  # early, so that most steps are committed after the stop
MODEL = {"in_dim": 16, "hidden": [32], "classes": 4}
# Leases of at most one microbatch and idle agents asking again soon: every step is made of
# several leases, so both agents keep talking to the site all through the run.
SITE_ENV = {
    "CROWDTRAIN_LEASE_TARGET_S": "0.2",
    "CROWDTRAIN_MAX_LEASE_SAMPLES": "16",
    "CROWDTRAIN_RETRY_AFTER_S": "0.2",
    "CROWDTRAIN_COMMITTER_MIN_LEASES": "1",  # these steps are small: the committer takes them anyway
}
# Its own Redis database: channel-layer groups are named after campaign ids, which every fresh database reuses.
REDIS_DB = 12
AGENT_SOCKET = re.compile(r'"WS(CONNECT|DISCONNECT) /ws/agent/"')
COMMITTED = re.compile(r"campaign \d+: step (\d+) committed")


def write_dataset(path: Path) -> None:
    write_projection_dataset(path, 2048, MODEL)


def spec(npz: Path) -> dict[str, Any]:
    return {
        "campaigns": [
            {
                "name": "MLP behind a balancer",
                "architecture": "mlp",
                "model_config": MODEL,
                "optimizer": {"name": "adamw", "lr": 1e-2},
                "dataset": {"kind": "npz", "path": str(npz), "name": "projection", "shard_bytes": 32 << 10},
                "target_batch_size": 64,
                "microbatch_size": 16,
                "staleness": 1,
                "max_steps": STEPS,
                "seed": 3,
            }
        ],
        "aggregators": ["agg-1"],
        "agents": ["agent-1", "agent-2"],
    }


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A cluster on a database of its own (dropped afterwards) and Redis database REDIS_DB."""
    try:
        server = engines.ensure_postgres(os.environ.get("DATABASE_URL") or DEFAULT_DATABASE_URL)
        redis = engines.ensure_redis(os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL)
    except engines.EngineError as exc:
        pytest.fail(str(exc))
    database_url = engines.with_database(server, f"crowdtrain_cluster_{uuid.uuid4().hex[:10]}")
    cluster = Cluster(
        tmp_path / "cluster",
        database_url=database_url,
        redis_url=engines.with_database(redis, str(REDIS_DB)),
        sites=2,
        port=0,
        env=SITE_ENV,
    )
    yield cluster
    cluster.stop(grace_s=5.0)
    engines.drop_database(cluster.database_url)


def progress(cluster: Cluster, campaign_id: int) -> dict[str, Any]:
    context = ssl.create_default_context(cafile=cluster.client_env().get("SSL_CERT_FILE"))
    with urllib.request.urlopen(
        f"{cluster.url}/api/campaigns/{campaign_id}/progress", timeout=10, context=context
    ) as response:
        return json.loads(response.read())


def wait_for_version(cluster: Cluster, campaign_id: int, version: int, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    seen: dict[str, Any] = {}
    while time.monotonic() < deadline:
        cluster.swarm.check()
        seen = progress(cluster, campaign_id)
        if seen["version"] >= version:
            return seen
        time.sleep(0.2)
    logs = "\n".join(f"--- {c.name}\n{c.log_tail(8)}" for c in cluster.swarm.children)
    pytest.fail(f"version {version} not reached in {timeout_s:.0f} s; last progress {seen}\n{logs}")


def open_agent_sockets(access_log: Path) -> int:
    """Agents' WebSockets a site process holds now, from daphne's access log."""
    events = AGENT_SOCKET.findall(access_log.read_text())
    return events.count("CONNECT") - events.count("DISCONNECT")


def committer_metric(cluster: Cluster, name: str) -> float:
    """A sample of the committer's /metrics (unlabelled), as Prometheus would scrape it from the same host."""
    url = f"http://127.0.0.1:{cluster.committer_metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 (loopback http)
        text = response.read().decode()
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert found, f"the committer's /metrics has no {name}"
    return float(found.group(1))


def test_two_site_processes_behind_haproxy_train_a_campaign_and_survive_losing_one(
    cluster: Cluster, tmp_path: Path
) -> None:
    write_dataset(tmp_path / "projection.npz")
    (tmp_path / "spec.json").write_text(json.dumps(spec(tmp_path / "projection.npz")))
    cluster.prepare()  # migrations, and `check --deploy --fail-level WARNING` on the sites' settings
    seed = json.loads(cluster.swarm.manage("seed_run", "--spec", str(tmp_path / "spec.json")))
    campaign_id = int(seed["campaigns"][0])
    logs = cluster.swarm.logs

    cluster.start()
    cluster.start_aggregators(seed["aggregators"])
    agents = [
        cluster.start_agent(token=token, name=name, campaign_id=campaign_id) for name, token in seed["agents"].items()
    ]
    wait_for_version(cluster, campaign_id, STOP_AT_VERSION, timeout_s=60)
    served = {site.child.name: (logs / f"{site.child.name}.access.log").read_text() for site in cluster.site_processes}
    busiest = max((1, 2), key=lambda i: open_agent_sockets(logs / f"site-{i}.access.log"))
    moved = open_agent_sockets(logs / f"site-{busiest}.access.log")
    at_stop = progress(cluster, campaign_id)  # before the stop: stopping may take longer than the rest of the run
    written = committer_metric(cluster, "crowdtrain_step_commit_seconds_count")
    assert cluster.committer is not None
    cluster.committer.expected_exit = True
    cluster.committer.signal(signal.SIGKILL)
    cluster.stop_site(busiest)
    done = wait_for_version(cluster, campaign_id, STEPS, timeout_s=60)
    dump = json.loads(cluster.swarm.manage("dump_run", "--campaign", str(campaign_id)))

    assert all('"WSCONNECT /ws/' in text for text in served.values()), "each site process should hold WebSockets"
    assert moved >= 1
    reconnected = [a.name for a in agents if "reconnected after" in a.log_path.read_text()]
    assert len(reconnected) >= moved, f"{moved} agent(s) lost their site process, reconnected: {reconnected}"
    assert at_stop["version"] < STEPS, "the campaign finished before the site process was gone"
    assert done["state"] == "finished" and len(done["losses"]) == STEPS
    assert sum(done["losses"][-3:]) / 3 < done["losses"][0], f"loss did not fall: {done['losses']}"
    by_committer = COMMITTED.findall((logs / "committer.log").read_text())
    assert by_committer, "the committer wrote no step before it was killed"
    assert written >= 1, "the committer's /metrics counted none of the steps it wrote"
    assert max(int(step) for step in by_committer) < STEPS - 1, "the sites wrote none after the committer died"
    seen = counted_samples(dump)
    assert max(seen.values()) == 1, "a sample was counted in two committed steps"
    assert all(step["num_samples"] >= 64 for step in dump["steps"])
