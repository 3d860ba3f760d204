"""A volunteer watches My devices while their agent trains: "Now:" changes without a reload, and the page fits a phone.

Vera has one device and opens My devices before its agent starts: it says
offline. A real aggregator and her real agent (CPU, one thread) then train a
tiny GPT; the same page (a marker set in it survives, so no reload happened)
shows the device online, what it does now, and its first leases.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from crowdtrain.accounts.models import Device
from tests.browser.live_site import LiveSite, Shot, log_in
from tests.browser.live_training import running_tiny_gpt, training_swarm
from tests.factories import make_organizer, make_volunteer

pytestmark = pytest.mark.timeout(180)

TRAINING_MS = 60_000  # the first lease usually comes a few seconds after the agent starts


def test_now_changes_without_a_reload_while_the_agent_trains(
    page: Page, shot: Shot, live_site: LiveSite, tmp_path: Path
) -> None:
    campaign = running_tiny_gpt(live_site, make_organizer("olga"))
    device, token = Device.issue(make_volunteer("vera"), "vera-laptop")
    page.set_viewport_size({"width": 390, "height": 844})
    log_in(page, "vera@example.org")

    page.goto(f"{live_site.url}/devices/")
    card = page.locator(f"#device-{device.pk}")
    now = card.locator("[data-live=now]")
    expect(now).to_have_text("offline")
    expect(card.locator("[data-live=badge]")).to_have_text("offline")
    expect(card.locator("[data-live=no-leases]")).to_be_visible()
    page.evaluate("window.__sameDevicesPage = true")  # gone if the page reloads

    with training_swarm(live_site, tmp_path / "swarm", campaign.pk, [token]):
        expect(card.locator("[data-live=badge]")).to_have_text("online now", timeout=TRAINING_MS)
        expect(now).not_to_have_text("offline")
        expect(card.locator("[data-live=leases] tr").first).to_contain_text("watched GPT", timeout=TRAINING_MS)
        expect(now).to_contain_text("watched GPT")  # a lease of it, its report, or its queue: all name it
        expect(card.locator("[data-live=speed]")).to_contain_text("samples/s", timeout=TRAINING_MS)
        shot(page, "training")
        assert page.evaluate("window.__sameDevicesPage === true"), "My devices reloaded instead of updating"

        # 390 px wide: the lease table scrolls in its own box, the page never sideways.
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= 390, f"My devices is {width} px wide on a 390 px phone"
