"""Each xdist worker of the PostgreSQL + Redis pass gets its own Redis database."""

import pytest

from tests.redis_per_worker import database_for


def test_workers_get_distinct_databases_counting_down_from_the_configured_one() -> None:
    url = "redis://127.0.0.1:6379/15"
    assert database_for(url, "gw0") == url
    assert database_for(url, "gw1") == "redis://127.0.0.1:6379/14"


def test_credentials_and_host_are_kept_and_no_database_means_zero() -> None:
    assert database_for("redis://:pw@redis.example:6380/3", "gw2") == "redis://:pw@redis.example:6380/1"
    assert database_for("redis://127.0.0.1:6379", "gw0") == "redis://127.0.0.1:6379/0"
    assert database_for("redis://127.0.0.1:6379", "gw1") == "redis://127.0.0.1:6379/15"
    with pytest.raises(SystemExit, match="too few for worker gw16"):
        database_for("redis://127.0.0.1:6379/15", "gw16")


def test_addresses_that_are_not_redis_are_left_alone() -> None:
    assert database_for("memory://", "gw1") == "memory://"
