"""Leaderboards in Chromium: they rank by credit, switch periods and subjects, and a volunteer watching sees their
rank change when their agent's work is committed, without reloading the page."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from django.db import transaction
from django.test import override_settings
from django.utils import timezone
from playwright.sync_api import Page, expect

from crowdtrain.accounts.models import Device, Profile, Team
from crowdtrain.campaigns.models import Campaign
from crowdtrain.credit import ledger
from crowdtrain.scheduler import hotstate
from crowdtrain.scheduler.models import Lease
from tests.browser.live_site import LiveSite, Shot, log_in
from tests.factories import make_campaign, make_volunteer


@pytest.fixture
def site_boards(live_site: LiveSite) -> Iterator[None]:
    """Credit this process grants lands on the site's own boards: its Redis database and key prefix."""
    if not live_site.redis_url:
        pytest.fail("the leaderboard browser test needs the site on Redis: run it as make test's third pass does")
    with override_settings(CROWDTRAIN_SCHEDULER_REDIS_URL=live_site.redis_url, CROWDTRAIN_REDIS_PREFIX="ct"):
        hotstate.reset_hot_state()
        yield
    hotstate.reset_hot_state()


def _commit_work(campaign: Campaign, device: Device, samples: int) -> None:
    """What a committed step does for one lease: its record, and its credit once the transaction commits."""
    with transaction.atomic():
        lease = Lease.objects.create(
            campaign=campaign, device=device, base_version=0, ranges=[[0, 0, 0, samples]], num_samples=samples,
            deadline=timezone.now(), state=Lease.State.ACCEPTED,
        )  # fmt: skip
        ledger.grant(campaign.pk, 1e9, [(lease.pk, device.pk, samples)])  # 1 GFLOP a sample: 1 credit a sample


def test_a_volunteer_watches_their_rank_rise_as_their_work_commits(page: Page, shot: Shot, site_boards: None) -> None:
    campaign = make_campaign()
    team = Team.objects.create(name="Night Owls")
    devices = {}
    for name, samples in (("ada", 300), ("grace", 200), ("linus", 100)):
        user = make_volunteer(name)
        Profile.objects.filter(user=user).update(display_name=name.capitalize(), team=team if name == "ada" else None)
        devices[name] = Device.issue(user, f"{name}-laptop")[0]
        _commit_work(campaign, devices[name], samples)
    log_in(page, "linus@example.org")

    page.goto("/leaderboards/?period=all")
    rows = page.locator("table.board tbody tr")
    expect(rows).to_have_count(3)
    expect(rows.nth(0)).to_contain_text("Ada")
    expect(rows.nth(2)).to_contain_text("Linus")
    expect(page.get_by_test_id("my-rank")).to_have_text("3")
    expect(page.locator("tr.board-mine")).to_contain_text("Linus")
    shot(page, "leaderboard all time")

    page.get_by_test_id("period-24h").click()
    expect(page).to_have_url(re.compile(r"period=24h"))
    expect(rows).to_have_count(3)
    page.get_by_test_id("of-teams").click()
    expect(rows).to_have_count(1)
    expect(rows.nth(0)).to_contain_text("Night Owls")
    page.get_by_test_id("of-volunteers").click()
    expect(page.get_by_test_id("my-rank")).to_have_text("3")

    _commit_work(campaign, devices["linus"], 250)  # his agent's next lease is committed while he watches

    expect(page.get_by_test_id("my-rank")).to_have_text("1", timeout=20_000)  # polled, no reload
    expect(page.get_by_test_id("my-credit")).to_have_text("350.000")
    expect(rows.nth(0)).to_contain_text("Linus")
    shot(page, "leaderboard after his work committed")
