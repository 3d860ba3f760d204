"""The scale bench's PostgreSQL and Redis: databases cloned from a template, an emptied Redis, lease states."""

from __future__ import annotations

from collections.abc import Sequence
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


def lease_states(database_url: str, lease_ids: Sequence[int]) -> tuple[dict[str, int], dict[int, str]]:
    """Leases per state and reason in the phase's database, and the state of each of ``lease_ids``."""
    import psycopg

    with psycopg.connect(database_url) as conn:
        summary = {
            f"{state}: {reason}" if reason else state: count
            for state, reason, count in conn.execute(
                "SELECT state, reason, count(*) FROM scheduler_lease GROUP BY state, reason ORDER BY 3 DESC"
            )
        }
        states = dict(conn.execute("SELECT id, state FROM scheduler_lease WHERE id = ANY(%s)", (list(lease_ids),)))
    return summary, states
