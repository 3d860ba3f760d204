"""Fixtures for multi-process runs: a Swarm in the test's own folder, seeding and reading back through manage.py.

Why subprocesses for the database: the site runs in a daphne child on an
SQLite file in the test's ``tmp_path``. pytest-django owns this process's
database settings (a test database, transactions rolled back), so instead of
pointing the ORM here at the child's file, the tests seed it with
``manage.py seed_run`` and read it back with ``manage.py dump_run`` under the
same ``CROWDTRAIN_VAR_DIR``, and watch progress over HTTP like a browser.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from crowdtrain_launcher import LaunchError, Site, Swarm, get_json

# No gradient graphs for tabs in the end-to-end runs: no tab joins them, and each site or seed_run that starts
# a campaign on the embedded default would spend 10-20 s of the two cores exporting one beside the timed run.
os.environ.setdefault("CROWDTRAIN_BROWSER_GRAPHS", "false")

# What an agent logs while the campaign waits for its aggregators (it has connected and asked).
WAITING_AGENT = re.compile(r"no lease from the site")


@dataclass
class Run:
    """One seeded local run: the swarm, the site once started, and what seed_run printed."""

    swarm: Swarm
    seed: dict[str, Any]
    site: Site | None = None

    @property
    def campaign_id(self) -> int:
        return int(self.seed["campaigns"][0])

    def start(self, *, agents_first: bool = False, agent_device: str = "cpu") -> Site:
        """Site, then every aggregator of the spec, then every agent (one torch thread each).

        With ``agents_first`` the agents start before the aggregators and are
        left to connect, so they all ask for work from the first step on
        (fast agents otherwise finish a short run before a slow one is up).
        """
        self.site = self.swarm.start_site()
        if not agents_first:
            self.swarm.start_aggregators(self.site, self.seed["aggregators"])
        agents = [
            self.swarm.start_agent(
                self.site, token=token, name=name, threads=1, campaign_id=self.campaign_id, device=agent_device
            )
            for name, token in self.seed["agents"].items()
        ]  # fmt: skip
        if agents_first:
            for agent in agents:  # best effort: the line is the agent's "no lease yet" log
                with contextlib.suppress(LaunchError):
                    agent.wait_for_line(WAITING_AGENT, timeout_s=30)
            self.swarm.start_aggregators(self.site, self.seed["aggregators"])
        return self.site

    def progress(self) -> dict[str, Any]:
        assert self.site is not None, "start() the run first"
        return get_json(f"{self.site.url}/api/campaigns/{self.campaign_id}/progress")

    def wait_for_version(self, version: int, timeout_s: float) -> dict[str, Any]:
        """Poll until ``version`` is published by every aggregator; fail with the logs if a process dies."""
        deadline = time.monotonic() + timeout_s
        progress: dict[str, Any] = {}
        while time.monotonic() < deadline:
            self.swarm.check()
            progress = self.progress()
            if progress["version"] >= version:
                return progress
            time.sleep(0.25)
        logs = "\n".join(f"--- {c.name}\n{c.log_tail(8)}" for c in self.swarm.children)
        pytest.fail(f"version {version} not reached in {timeout_s:.0f} s; last progress {progress}\n{logs}")

    def dump(self) -> dict[str, Any]:
        return json.loads(self.swarm.manage("dump_run", "--campaign", str(self.campaign_id)))


@contextlib.contextmanager
def service_database() -> Iterator[dict[str, str]]:
    """Where the test run has PostgreSQL and Redis (``make test``'s second pass), the children use them too.

    Each run gets a database of its own, dropped afterwards; with the
    embedded defaults this is empty and the children use SQLite in their var folder.
    """
    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith(("postgres://", "postgresql://")):
        yield {}
        return
    import psycopg

    name = f"crowdtrain_e2e_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    parts = urlsplit(url)
    env = {"DATABASE_URL": urlunsplit(parts._replace(path=f"/{name}"))}
    redis_url = os.environ.get("REDIS_URL", "")
    if redis_url:
        # Keys of its own too: a fresh database reuses campaign, check and lease ids, which the scheduler's
        # keys are named after, so an earlier run's keys would speak for this run's rows.
        env["REDIS_URL"], env["CROWDTRAIN_REDIS_PREFIX"] = redis_url, name
    try:
        yield env
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        if redis_url:
            import redis

            client = redis.Redis.from_url(redis_url)
            keys = list(client.scan_iter(match=f"{name}:*", count=1000))
            if keys:
                client.delete(*keys)


@pytest.fixture
def service_env() -> Iterator[dict[str, str]]:
    """The environment of ``service_database`` for one test."""
    with service_database() as env:
        yield env


def seed(swarm: Swarm, spec: dict[str, Any], spec_path: Path) -> dict[str, Any]:
    """Migrate the swarm's database and seed ``spec`` into it; returns what seed_run printed."""
    spec_path.write_text(json.dumps(spec))
    return json.loads(swarm.manage("seed_run", "--migrate", "--spec", str(spec_path)))


@pytest.fixture
def seeded_run(tmp_path: Path, service_env: dict[str, str]) -> Iterator[Any]:
    """A factory: ``seeded_run(spec, site_env, name)`` migrates and seeds a fresh var folder (one per name);
    everything stops at teardown."""
    swarms: list[Swarm] = []

    def make(spec: dict[str, Any], site_env: dict[str, str] | None = None, name: str = "run") -> Run:
        env = {"CROWDTRAIN_VAR_DIR": str(tmp_path / name / "var"), **service_env, **(site_env or {})}
        swarm = Swarm(tmp_path / name, env=env)
        swarms.append(swarm)
        return Run(swarm, seed(swarm, spec, tmp_path / f"{name}-spec.json"))

    yield make
    for swarm in swarms:
        swarm.stop(grace_s=5.0)
