"""A newcomer who signs up from a campaign's join page comes back to it, logged in, once her address is confirmed.

Seen in issue 34: after confirming she was sent to Sign In, and after signing
in she landed on Home, far from the page she had started from.
"""

from __future__ import annotations

import pytest
from playwright.sync_api import Page, expect

from tests.browser.live_site import LiveSite, Outbox, Shot
from tests.factories import make_campaign

pytestmark = pytest.mark.timeout(120)
PASSWORD = "indigo-tensor-41"


def test_signing_up_from_a_join_page_returns_to_it_logged_in(
    page: Page, shot: Shot, live_site: LiveSite, outbox: Outbox
) -> None:
    campaign = make_campaign()
    join = f"{live_site.url}/campaigns/{campaign.pk}/join"
    page.goto(join)
    page.get_by_role("link", name="Sign up").click()
    page.get_by_label("Email").fill("hedy@example.org")
    page.get_by_label("Password:", exact=True).fill(PASSWORD)
    page.get_by_label("Password (again)").fill(PASSWORD)
    page.get_by_role("button", name="Sign Up").click()
    expect(page.get_by_role("heading", name="Verify Your Email Address")).to_be_visible()

    mail = outbox.newest(to="hedy@example.org")
    [confirm] = [link for link in mail.links if "/accounts/confirm-email/" in link][:1]
    page.goto(confirm)
    page.get_by_role("button", name="Confirm").click()

    expect(page).to_have_url(join)
    expect(page.get_by_role("button", name="Log out")).to_be_visible()
    shot(page, "back on the join page")
