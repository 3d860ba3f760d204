"""The site's daphne has redis-py read its own version once, not from package metadata for every connection."""

from __future__ import annotations

from importlib import metadata

import pytest
import redis
import redis.utils

from crowdtrain.lib import patches


def test_new_connections_stop_reading_package_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redis.utils, "get_lib_version", redis.utils.get_lib_version)  # restored afterwards
    reads: list[str] = []
    real_version = metadata.version

    def counted(name: str) -> str:
        reads.append(name)
        return real_version(name)

    monkeypatch.setattr(metadata, "version", counted)
    redis.Connection(host="127.0.0.1", port=6379)
    assert reads == ["redis"], "each new connection reads the metadata (redis-py as measured)"

    patches.redis_version_read_once()
    connections = [redis.Connection(host="127.0.0.1", port=6379) for _ in range(3)]

    assert reads == ["redis", "redis"]  # once more, for the cache; then never
    assert {c.driver_info.lib_version for c in connections} == {real_version("redis")}
