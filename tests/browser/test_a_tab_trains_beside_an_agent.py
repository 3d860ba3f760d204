"""A volunteer computes in a browser tab beside another volunteer's Python agent, in Chromium, on a running campaign.

The campaign is the tiny GPT the other live-training tests watch; its graph is
exported and gated as a campaign's start has the site's worker do. One
volunteer runs the Python agent; another logs in, opens the campaign's join
page and follows "Compute in this tab". The tab's accepted work shows as
credit on the leaderboard, like any device's. She then sets an upload limit on
My devices, which the tab takes at once; its next upload is slow, and the tab
is closed in the middle of it: that lease is given back, and every one of its
samples is trained by the agent within the same epoch, counted exactly once.
"""

from __future__ import annotations

import io
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from django.core.management import call_command
from django.db import connection
from django.test import override_settings
from playwright.sync_api import Page, expect

from crowdtrain.accounts.models import Device
from crowdtrain.browser.models import BrowserGraph
from crowdtrain.credit.models import CreditEntry
from crowdtrain.scheduler.models import Lease
from tests.browser.live_site import LiveSite, Shot, log_in
from tests.browser.live_training import running_tiny_gpt, training_swarm
from tests.factories import make_organizer, make_volunteer

pytestmark = pytest.mark.timeout(420)
CREDIT_S = 180.0  # the tab's first accepted lease, on two busy cores: site, aggregator, agent and Chromium
YOUR_CREDIT = re.compile(r"You: rank \d+ with ([0-9.]+) credit")  # the leaderboard's line for whoever watches


def _gate(campaign_id: int, media: Path) -> str:
    """What a campaign's start queues for the site's worker, run to the end here; its progress line.

    The graphs go where the site process serves them from: its media folder.
    """

    def run() -> str:
        out = io.StringIO()
        try:
            with override_settings(CROWDTRAIN_BROWSER_GRAPHS=True, MEDIA_ROOT=str(media)):
                call_command("check_browser_graphs", "--campaign", str(campaign_id), stdout=out)
        finally:
            connection.close()
        return out.getvalue()

    # Off Playwright's thread: Django refuses ORM calls next to its running event loop.
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(run).result()


def _samples(ranges: list[list[int]]) -> set[tuple[int, int]]:
    """(shard index, sample) pairs of a lease's ``[epoch, shard, start, count]`` ranges."""
    return {(shard, i) for _, shard, start, count in ranges for i in range(start, start + count)}


def test_a_tab_is_credited_beside_an_agent_and_closing_it_loses_no_sample(
    page: Page, shot: Shot, live_site: LiveSite, tmp_path: Path
) -> None:
    campaign = running_tiny_gpt(live_site, make_organizer("olga"))
    verdict = _gate(campaign.pk, live_site.log_path.parent.parent / "media")
    graph = BrowserGraph.objects.get()
    assert graph.status == BrowserGraph.Status.PASSED, (verdict, graph.reason)
    agent_owner = make_volunteer("ada")
    _, agent_token = Device.issue(agent_owner, "ada-laptop")
    make_volunteer("tabitha")
    with training_swarm(live_site, tmp_path / "swarm", campaign.pk, [agent_token]):
        log_in(page, "tabitha@example.org")
        page.goto(f"/campaigns/{campaign.pk}/join")
        page.get_by_role("link", name="Compute in this tab").click()
        leases_done = page.locator("#tab-leases")
        expect(leases_done).not_to_have_text("0", timeout=CREDIT_S * 1000)
        shot(page, "the tab has finished a lease")
        tab = Device.objects.get(owner__username="tabitha")
        assert tab.hardware.get("kind") == "browser", tab.hardware

        # Credit, as any device's: granted to the tab in the ledger, and on the leaderboard she watches.
        board = page.context.new_page()
        deadline = time.monotonic() + CREDIT_S
        while True:
            granted = CreditEntry.objects.filter(device=tab, kind=CreditEntry.Kind.GRANT).count()
            board.goto("/leaderboards/?period=all")
            mine = YOUR_CREDIT.search(board.locator("main").inner_text())
            if granted and mine and float(mine.group(1)) > 0:
                break
            assert time.monotonic() < deadline, f"the tab's work never showed: {granted} grants, board {mine}"
            time.sleep(2.0)
        shot(board, "the tab's volunteer on the leaderboard")

        # Her upload limit, set on My devices, reaches the tab at once: a lease's upload now takes a minute.
        board.goto("/devices/")
        controls = board.get_by_test_id(f"controls-{tab.pk}")
        controls.locator("summary").click()
        controls.get_by_label("Upload at most").fill("8")
        controls.get_by_role("button", name="Save controls").click()
        expect(board.get_by_text("Saved the controls of")).to_be_visible()
        board.close()

        # Closed in the middle of a lease: the lease goes back, the agent trains its samples.
        expect(page.locator("#tab-status")).to_contain_text("uploading", timeout=60_000)
        computing = page.locator("[data-testid=tab-panel][data-lease]:not([data-lease=''])")
        expect(computing).to_have_count(1)
        lease_id = int(computing.get_attribute("data-lease") or 0)
        time.sleep(2.0)
        expect(page.locator("#tab-status")).to_contain_text(f"lease {lease_id}: uploading")
        shot(page, "the tab is uploading at 8 kbit/s when it is closed")
        page.close(run_before_unload=True)
        deadline = time.monotonic() + 120
        while True:
            lease = Lease.objects.filter(pk=lease_id).first()
            if lease is not None and lease.state != Lease.State.ACTIVE:
                break
            assert time.monotonic() < deadline, f"lease {lease_id} was still held two minutes after the tab closed"
            time.sleep(1.0)
        assert lease.state == Lease.State.RELEASED, f"lease {lease_id} ended {lease.state}, not given back"
        wanted = _samples(lease.ranges)
        deadline = time.monotonic() + 120
        while True:
            redone = [
                row
                for row in Lease.objects.filter(campaign=campaign, state=Lease.State.ACCEPTED, epoch=lease.epoch)
                if _samples(row.ranges) & wanted
            ]
            covered = set().union(*(_samples(row.ranges) & wanted for row in redone)) if redone else set()
            if covered == wanted:
                break
            assert time.monotonic() < deadline, f"{len(wanted - covered)} samples of lease {lease_id} never trained"
            time.sleep(1.0)
        assert all(row.device_id != tab.pk for row in redone), "the closed tab's samples were credited to the tab"
        counted = sum(len(_samples(row.ranges) & wanted) for row in redone)
        assert counted == len(wanted), f"{counted - len(wanted)} samples of lease {lease_id} were trained twice"
