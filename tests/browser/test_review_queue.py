"""Quarantine in Chromium: a quarantined volunteer reads why and appeals, an admin reads the appeal in the review
queue and clears them, and the volunteer's standing page then says they are in good standing."""

from __future__ import annotations

from collections.abc import Callable

from playwright.sync_api import BrowserContext, Page, expect

from crowdtrain.accounts.models import Profile
from crowdtrain.verification import quarantine
from tests.browser.live_site import Shot, log_in
from tests.factories import make_admin, make_volunteer

REASON = "2 of 3 of its results disagreed with those of other volunteers who computed the same samples"
APPEAL = "My GPU was overclocked by its vendor's tool; I have reset it to stock clocks."


def test_a_quarantined_volunteer_appeals_and_an_admin_clears_them(
    page: Page, new_context: Callable[..., BrowserContext], shot: Shot
) -> None:
    vera = make_volunteer("vera")
    Profile.objects.filter(user=vera).update(display_name="Vera V.")
    quarantine.quarantine(vera.pk, REASON)
    make_admin("ada")

    # The volunteer finds her standing from her profile, and appeals.
    log_in(page, "vera@example.org")
    page.goto("/me/")
    expect(page.get_by_test_id("profile-standing")).to_contain_text("quarantined")
    page.get_by_role("link", name="Your standing").click()
    expect(page.get_by_test_id("standing-state")).to_contain_text("quarantined")
    expect(page.get_by_test_id("standing-reason")).to_have_text(REASON)
    expect(page.get_by_role("heading", name="What quarantine means")).to_be_visible()
    page.get_by_label("Your appeal").fill("sorry")
    page.get_by_role("button", name="Send my appeal").click()
    expect(page.locator("#id_appeal_error")).to_have_text("Your appeal needs at least 10 characters (it has 5).")
    page.get_by_label("Your appeal").fill(APPEAL)
    page.get_by_role("button", name="Send my appeal").click()
    expect(page.get_by_text("Appeal sent.")).to_be_visible()
    expect(page.get_by_test_id("appeal-sent")).to_be_visible()
    shot(page, "volunteer appealed")

    # An admin, in a browser of her own, opens the queue from the nav and clears her.
    admin = new_context().new_page()
    log_in(admin, "ada@example.org")
    admin.get_by_role("navigation", name="Main").get_by_role("link", name="Review queue").click()
    entry = admin.get_by_test_id("review-entry")
    expect(entry).to_have_count(1)
    expect(entry).to_contain_text("Vera V.")
    expect(entry).to_contain_text("vera@example.org")
    expect(entry.get_by_test_id("appeal")).to_have_text(APPEAL)
    shot(admin, "review queue")
    entry.get_by_role("button", name="Clear").click()
    expect(admin.get_by_text("Cleared Vera V. (vera@example.org)")).to_be_visible()
    expect(admin.get_by_test_id("queue-empty")).to_have_text("No volunteer is in quarantine.")
    shot(admin, "queue after clearing")

    # The volunteer's page says so.
    page.reload()
    expect(page.get_by_test_id("standing-state")).to_contain_text("in good standing")
    expect(page.get_by_label("Your appeal")).to_have_count(0)
    shot(page, "volunteer in good standing")
