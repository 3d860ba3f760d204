"""What browser tests need to watch real training: a running tiny-GPT campaign, a real aggregator and real agents."""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from django.contrib.auth.models import AbstractBaseUser
from django.core.management import call_command
from django.db import connection
from django.test import override_settings

from crowdtrain.campaigns import lifecycle
from crowdtrain.campaigns.models import Campaign
from crowdtrain.campaigns.setup import create_campaign
from crowdtrain.datasets.sharding import create_text_dataset, stdlib_corpus
from crowdtrain_launcher import Site, Swarm
from tests.browser.live_site import LiveSite

SAMPLE_LEN = 17  # block_size + 1: the input bytes and the next byte of the last one


def backbone_token(name: str) -> str:
    """What an operator runs to register an aggregator: ``manage.py create_backbone_token --name NAME``."""
    out = io.StringIO()
    call_command("create_backbone_token", "--name", name, stdout=out)
    return out.getvalue().strip()


def _start(campaign_id: int, organizer: AbstractBaseUser) -> None:
    try:
        lifecycle.apply_move(campaign_id, "start", organizer)
    finally:
        connection.close()  # this thread's own connection would keep the test database from being dropped


def running_tiny_gpt(live_site: LiveSite, organizer: AbstractBaseUser) -> Campaign:
    """The started campaign "watched GPT" of ``organizer``: a tiny GPT on 20 KiB of the standard library.

    It has no aggregator yet; ``max_steps`` is far above what a test reaches.
    """
    # The shards go where the site process reads them (its media folder, beside its log folder).
    with override_settings(MEDIA_ROOT=str(live_site.log_path.parent.parent / "media")):
        dataset = create_text_dataset("stdlib", stdlib_corpus(20 << 10), SAMPLE_LEN, shard_bytes=4096)
    campaign = create_campaign(
        name="watched GPT", owner=organizer, dataset=dataset, architecture="gpt",
        model_config={"n_layer": 1, "n_head": 1, "n_embd": 16, "block_size": 16},
        target_batch_size=32, microbatch_size=16, max_steps=100_000,
    )  # fmt: skip
    # Starting wakes agents through the channel layer (async_to_sync), which refuses the thread that
    # runs Playwright's event loop: start it from another thread.
    with ThreadPoolExecutor(1) as pool:
        pool.submit(_start, campaign.pk, organizer).result()
    campaign.refresh_from_db()
    return campaign


@contextmanager
def training_swarm(live_site: LiveSite, folder: Path, campaign_id: int, agent_tokens: Sequence[str]) -> Iterator[Swarm]:
    """A real aggregator "agg-1" and one real agent (CPU, one thread) per device token, working for the live site.

    Leaving the block stops the agents, then the aggregator.
    """
    site = Site(live_site.url, live_site.swarm.children[0])
    with Swarm(folder) as swarm:
        swarm.start_aggregator(site, token=backbone_token("agg-1"), name="agg-1")
        for token in agent_tokens:
            swarm.start_agent(site, token=token, threads=1, campaign_id=campaign_id)
        yield swarm
