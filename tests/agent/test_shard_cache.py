"""Shards are verified by sha256, cached on disk, and fetched again when the cached copy is damaged."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from crowdtrain_agent.fetch import FetchError, ShardCache

from .fakes import GOOD_TOKEN, World


def _cache(world: World, root: Path) -> ShardCache:
    return ShardCache(root, f"{world.site.url}/api/shards", GOOD_TOKEN)


async def test_it_downloads_once_and_serves_later_runs_from_disk(world: World, tmp_path: Path) -> None:
    first = await asyncio.to_thread(_cache(world, tmp_path).get, world.sha)

    second = await asyncio.to_thread(_cache(world, tmp_path).get, world.sha)  # a fresh process: empty memory

    assert first == second == world.shard
    assert world.site.shard_requests == [world.sha]


async def test_a_corrupted_cached_shard_is_fetched_again(world: World, tmp_path: Path) -> None:
    cache = _cache(world, tmp_path)
    await asyncio.to_thread(cache.get, world.sha)
    cache.path_for(world.sha).write_bytes(b"bit rot" + world.shard[7:])

    data = await asyncio.to_thread(_cache(world, tmp_path).get, world.sha)

    assert data == world.shard
    assert cache.path_for(world.sha).read_bytes() == world.shard
    assert world.site.shard_requests == [world.sha, world.sha]


async def test_bytes_that_do_not_match_their_sha256_are_refused(world: World, tmp_path: Path) -> None:
    world.site.shards[world.sha] = world.shard + b"tampered"
    cache = _cache(world, tmp_path)

    with pytest.raises(FetchError, match="sha256"):
        await asyncio.to_thread(cache.get, world.sha)

    assert not cache.path_for(world.sha).exists()


async def test_a_shard_name_that_is_not_a_digest_is_refused_before_any_download(world: World, tmp_path: Path) -> None:
    with pytest.raises(FetchError, match="not a lower-case sha256"):
        await asyncio.to_thread(_cache(world, tmp_path).get, "../../etc/passwd")

    assert world.site.shard_requests == []


async def test_two_threads_asking_for_one_shard_download_it_once(world: World, tmp_path: Path) -> None:
    world.site.shard_delay_s = 0.2  # the second asks while the first is still downloading
    cache = _cache(world, tmp_path)

    first, second = await asyncio.gather(
        asyncio.to_thread(cache.get, world.sha), asyncio.to_thread(cache.get, world.sha)
    )

    assert first == second == world.shard
    assert world.site.shard_requests == [world.sha]
    assert cache.in_memory(world.sha)
