"""A volunteer sets when her device may work on My devices, in Chromium; a control that means nothing is refused."""

from __future__ import annotations

import pytest
from playwright.sync_api import Page, expect

from crowdtrain.accounts.models import Device
from tests.browser.live_site import LiveSite, Shot, log_in
from tests.factories import make_volunteer

pytestmark = pytest.mark.timeout(120)


def test_a_volunteer_sets_her_devices_controls(page: Page, shot: Shot, live_site: LiveSite) -> None:
    device, _ = Device.issue(make_volunteer("vera"), "vera-laptop")
    log_in(page, "vera@example.org")
    page.goto(f"{live_site.url}/devices/")

    controls = page.get_by_test_id(f"controls-{device.pk}")
    controls.locator("summary").click()
    controls.get_by_label("Schedule").fill("mon-fri 18:00-08:00")
    controls.get_by_label("Pause on battery").check()
    controls.get_by_label("Upload at most").fill("2000")
    shot(page, "controls filled in")
    controls.get_by_role("button", name="Save controls").click()
    expect(page.get_by_text("Saved the controls of vera-laptop")).to_be_visible()

    device.refresh_from_db()
    assert device.controls == {"schedule": "mon-fri 18:00-08:00", "pause_on_battery": True, "upload_kbps": 2000.0}

    controls.locator("summary").click()
    expect(controls.get_by_label("Schedule")).to_have_value("mon-fri 18:00-08:00")
    controls.get_by_label("Schedule").fill("weekends")
    controls.get_by_role("button", name="Save controls").click()
    expect(page.get_by_text("were not changed: schedule part 'weekends'")).to_be_visible()
    shot(page, "a schedule refused by name")
    device.refresh_from_db()
    assert device.controls["schedule"] == "mon-fri 18:00-08:00", "a refused change changes nothing"
