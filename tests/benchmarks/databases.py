"""The scale bench's databases: PostgreSQL ones cloned from a template, an emptied Redis, lease states."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from contextlib import closing
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit


def with_database(url: str, name: str) -> str:
    """``url`` with its database name replaced."""
    return urlunsplit(urlsplit(url)._replace(path=f"/{name}"))


def database_name(url: str) -> str:
    return urlsplit(url).path.lstrip("/")


def recreate_database(server_url: str, name: str, template: str | None = None) -> None:
    """Drop ``name`` (closing its connections) and create it again, empty or as a copy of ``template``."""
    import psycopg

    with psycopg.connect(with_database(server_url, "postgres"), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else ""))


def flush_redis(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()


def copy_sqlite(source: Path, target: Path) -> None:
    """A consistent copy of an SQLite file, whatever its write-ahead log still holds (the site runs in WAL mode)."""
    with closing(sqlite3.connect(f"file:{source}?mode=ro", uri=True)) as src, closing(sqlite3.connect(target)) as dst:
        src.backup(dst)


SUMMARY = "SELECT state, reason, count(*) FROM scheduler_lease GROUP BY state, reason ORDER BY 3 DESC"


def lease_states(database: str, lease_ids: Sequence[int]) -> tuple[dict[str, int], dict[int, str]]:
    """Leases per state and reason in the phase's database, and the state of each of ``lease_ids``
    (``state: reason`` where the lease has a reason, as the summary names them).

    ``database``: a PostgreSQL URL, or the path of the embedded default's SQLite file.
    """
    if "://" not in database:
        with closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as lite:
            summary = {
                f"{state}: {reason}" if reason else state: count for state, reason, count in lite.execute(SUMMARY)
            }
            states: dict[int, str] = {}
            ids = list(lease_ids)
            for start in range(0, len(ids), 500):  # SQLite binds at most 999 variables
                chunk = ids[start : start + 500]
                marks = ",".join("?" * len(chunk))
                rows = lite.execute(f"SELECT id, state, reason FROM scheduler_lease WHERE id IN ({marks})", chunk)
                states.update((i, f"{state}: {reason}" if reason else state) for i, state, reason in rows)
        return summary, states
    import psycopg

    with psycopg.connect(database) as conn:
        summary = {f"{state}: {reason}" if reason else state: count for state, reason, count in conn.execute(SUMMARY)}
        rows = conn.execute("SELECT id, state, reason FROM scheduler_lease WHERE id = ANY(%s)", (list(lease_ids),))
        states = {i: f"{state}: {reason}" if reason else state for i, state, reason in rows}
    return summary, states


# Each applied step: when its row was created (the commit's write starting), when the aggregators' new
# version was recorded, and how many leases it holds.
STEP_TIMES = (
    "SELECT s.committed_at, s.applied_at, (SELECT count(*) FROM scheduler_lease l WHERE l.step_id = s.id) "
    'FROM campaigns_step s WHERE s.applied_at IS NOT NULL ORDER BY s."index"'
)


def step_publish_times(database: str) -> list[tuple[int, float]]:
    """(leases, seconds) for each applied step: from the start of its commit's write to its version published.

    The whole commit pipeline: the step's transaction (its lease rows, credit, ledger),
    the commit reaching the aggregators, their optimizer step, and the site recording
    the new version. Leases of the step after next wait on it (staleness 1), so when it
    takes longer than the swarm needs to fill a step, agents wait for room.
    """
    if "://" not in database:
        with closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as lite:
            rows = [(datetime.fromisoformat(a), datetime.fromisoformat(b), n) for a, b, n in lite.execute(STEP_TIMES)]
    else:
        import psycopg

        with psycopg.connect(database) as conn:
            rows = list(conn.execute(STEP_TIMES))
    return [(int(n), (applied - committed).total_seconds()) for committed, applied, n in rows]


# Verification work in a time window: checks opened (a lease picked, its copy queued) and copies reported.
CHECKS_OPENED = "SELECT count(*) FROM verification_check WHERE created_at >= {p} AND created_at < {p}"
COPIES_REPORTED = (
    "SELECT count(*) FROM verification_answer WHERE role <> 'original' AND reported_at >= {p} AND reported_at < {p}"
)


def verification_counts(database: str, since: float, until: float) -> tuple[int, int]:
    """(checks opened, copies reported) between two Unix times, in the phase's database.

    Every bench volunteer is a newcomer, checked at four times the campaign's rate until
    their first checks pass, so this share of the cycles is verification work and it
    moves the site's CPU per lease: a phase whose volunteers pass their checks sooner
    has less of it.
    """
    bounds = [datetime.fromtimestamp(t, UTC) for t in (since, until)]
    if "://" not in database:
        # Django stores SQLite datetimes as UTC text, "YYYY-MM-DD HH:MM:SS.ffffff", which sorts as time does.
        text = [b.replace(tzinfo=None).isoformat(" ", "microseconds") for b in bounds]
        with closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as lite:
            opened = lite.execute(CHECKS_OPENED.format(p="?"), text).fetchone()[0]
            reported = lite.execute(COPIES_REPORTED.format(p="?"), text).fetchone()[0]
        return int(opened), int(reported)
    import psycopg

    with psycopg.connect(database) as conn:
        opened = conn.execute(CHECKS_OPENED.format(p="%s"), bounds).fetchone()
        reported = conn.execute(COPIES_REPORTED.format(p="%s"), bounds).fetchone()
    return int(opened[0]) if opened else 0, int(reported[0]) if reported else 0
