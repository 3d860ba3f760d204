"""An admin watches the live dashboard in Chromium while real agents train: it moves without a reload, and a killed
aggregator shows up as an alert within its heartbeat window.

Ada opens /dashboard/ on a running campaign with no aggregator yet: the
campaign's loss chart says "No data yet" and the "waiting for aggregators"
alert says what to do. A real backbone aggregator and two volunteers' real
agents (CPU, one thread each) then train a tiny GPT; the step counter and the
loss chart change on the same page (a marker set in the page survives, so no
reload happened). Then the aggregator is killed (SIGKILL, no goodbye), and the
"aggregator silent" alert appears.
"""

from __future__ import annotations

import io
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.core.management import call_command
from django.db import connection
from django.test import override_settings
from playwright.sync_api import Page, expect

from crowdtrain.accounts.models import Device
from crowdtrain.campaigns import lifecycle
from crowdtrain.campaigns.setup import create_campaign
from crowdtrain.campaigns.sharding import create_text_dataset, stdlib_corpus
from crowdtrain_launcher import REPO_ROOT, Site, Swarm
from tests.browser.live_site import LiveSite, Shot, log_in
from tests.factories import make_admin, make_organizer, make_volunteer

pytestmark = pytest.mark.timeout(240)

CHARTS_BUNDLE = REPO_ROOT / "frontend" / "static" / "build" / "charts.js"
SAMPLE_LEN = 17  # block_size + 1
TRAINING_MS = 90_000  # a generous bound: the first step usually comes some 5 s after the agents start
# The site calls an aggregator gone after CROWDTRAIN_GONE_AFTER_S without a heartbeat (a killed one's
# socket usually closes at once); the page hears of it at the next push.
SILENT_MS = int((settings.CROWDTRAIN_GONE_AFTER_S + 3 * settings.CROWDTRAIN_DASHBOARD_PUSH_S + 10) * 1000)


def backbone_token(name: str) -> str:
    out = io.StringIO()
    call_command("create_backbone_token", "--name", name, stdout=out)
    return out.getvalue().strip()


def start(campaign_id: int, organizer: Any) -> None:
    try:
        lifecycle.apply_move(campaign_id, "start", organizer)
    finally:
        connection.close()  # this thread's own connection would keep the test database from being dropped


def test_the_dashboard_moves_while_agents_train_and_flags_a_killed_aggregator(
    page: Page, shot: Shot, live_site: LiveSite, tmp_path: Path
) -> None:
    assert CHARTS_BUNDLE.is_file(), f"{CHARTS_BUNDLE} is missing: build it with `make charts` (npm ci, npm run build)"
    organizer = make_organizer("olga")
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
        pool.submit(start, campaign.pk, organizer).result()
    agent_tokens = [Device.issue(make_volunteer(name), f"{name}-laptop")[1] for name in ("vera", "victor")]
    make_admin("ada")
    log_in(page, "ada@example.org")

    # Before any aggregator: the campaign is there, its charts say there is nothing yet, an alert says why.
    page.get_by_role("link", name="Dashboard").click()
    expect(page).to_have_url(f"{live_site.url}/dashboard/")
    box = page.locator(f'[data-campaign="{campaign.pk}"]')
    expect(box).to_be_visible()
    loss_chart = page.get_by_test_id(f"chart-loss-{campaign.pk}")
    expect(loss_chart.get_by_test_id("chart-empty")).to_have_text("No data yet")
    expect(loss_chart.get_by_test_id("chart-empty")).to_be_visible()
    waiting = page.locator('[data-testid=alert][data-code="campaign_waiting_for_aggregators"]')
    expect(waiting).to_contain_text("What to do:")
    shot(page, "no data yet")
    page.evaluate("window.__sameDashboardPage = true")  # gone if the page reloads

    site = Site(live_site.url, live_site.swarm.children[0])
    with Swarm(tmp_path / "swarm") as swarm:
        swarm.start_aggregator(site, token=backbone_token("agg-1"), name="agg-1")
        for token in agent_tokens:
            swarm.start_agent(site, token=token, threads=1, campaign_id=campaign.pk)

        # Training: the step counter and the loss chart move, on the same page.
        steps = page.get_by_test_id(f"steps-{campaign.pk}")
        expect(steps).not_to_have_text("0", timeout=TRAINING_MS)
        expect(loss_chart.get_by_test_id("chart-empty")).to_be_hidden()
        expect(waiting).to_have_count(0)
        first_steps = steps.inner_text()
        first_loss = loss_chart.get_attribute("data-signature")
        shot(page, "training")
        expect(steps).not_to_have_text(first_steps, timeout=TRAINING_MS)
        expect(loss_chart).not_to_have_attribute("data-signature", first_loss or "", timeout=TRAINING_MS)
        expect(page.get_by_test_id("agents-online")).not_to_have_text("0")
        expect(page.get_by_test_id("aggregators")).to_contain_text("agg-1")
        assert page.evaluate("window.__sameDashboardPage === true"), "the dashboard reloaded instead of updating"
        shot(page, "still training")

        # The aggregator dies without a word: the alert appears within its heartbeat window.
        aggregator = next(child for child in swarm.children if child.role == "aggregator")
        aggregator.signal(signal.SIGKILL)
        silent = page.locator('[data-testid=alert][data-code="aggregator_silent"]')
        expect(silent).to_be_visible(timeout=SILENT_MS)
        expect(silent).to_contain_text("agg-1")
        expect(silent).to_contain_text("What to do:")
        assert page.evaluate("window.__sameDashboardPage === true")
        shot(page, "aggregator silent")
