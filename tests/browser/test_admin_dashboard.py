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

import signal
from pathlib import Path

import pytest
from django.conf import settings
from playwright.sync_api import Page, expect

from crowdtrain.accounts.models import Device
from crowdtrain_launcher import REPO_ROOT
from tests.browser.live_site import LiveSite, Shot, log_in
from tests.browser.live_training import running_tiny_gpt, training_swarm
from tests.factories import make_admin, make_organizer, make_volunteer

pytestmark = pytest.mark.timeout(240)

CHARTS_BUNDLE = REPO_ROOT / "frontend" / "static" / "build" / "charts.js"
TRAINING_MS = 90_000  # a generous bound: the first step usually comes some 5 s after the agents start
# The site calls an aggregator gone after CROWDTRAIN_GONE_AFTER_S without a heartbeat (a killed one's
# socket usually closes at once); the page hears of it at the next push.
SILENT_MS = int((settings.CROWDTRAIN_GONE_AFTER_S + 3 * settings.CROWDTRAIN_DASHBOARD_PUSH_S + 10) * 1000)


def test_the_dashboard_moves_while_agents_train_and_flags_a_killed_aggregator(
    page: Page, shot: Shot, live_site: LiveSite, tmp_path: Path
) -> None:
    assert CHARTS_BUNDLE.is_file(), f"{CHARTS_BUNDLE} is missing: build it with `make charts` (npm ci, npm run build)"
    campaign = running_tiny_gpt(live_site, make_organizer("olga"))
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

    with training_swarm(live_site, tmp_path / "swarm", campaign.pk, agent_tokens) as swarm:
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
