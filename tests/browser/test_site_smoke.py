"""Smoke: Chromium renders the campaign status page and lets staff through the admin login, against the live site."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from playwright.sync_api import Page, expect

from tests.browser.live_site import LiveSite, Shot
from tests.factories import make_campaign


def test_the_status_page_shows_a_running_campaign_seeded_through_the_orm(page: Page, shot: Shot) -> None:
    campaign = make_campaign()
    campaign.name = "Smoke-test GPT"
    campaign.save(update_fields=["name"])

    page.goto("/")

    expect(page.get_by_role("heading", name="Smoke-test GPT")).to_be_visible()
    shot(page, "status page")


def test_staff_log_in_to_the_admin(page: Page, shot: Shot, live_site: LiveSite) -> None:
    get_user_model().objects.create_superuser("ada", "ada@example.org", "correct horse battery")

    page.goto("/admin/login/")
    shot(page, "admin login")
    page.get_by_label("Username").fill("ada")
    page.get_by_label("Password").fill("correct horse battery")
    page.get_by_role("button", name="Log in").click()

    expect(page).to_have_url(f"{live_site.url}/admin/")
    expect(page.get_by_role("button", name="Log out")).to_be_visible()
    shot(page, "admin index")
