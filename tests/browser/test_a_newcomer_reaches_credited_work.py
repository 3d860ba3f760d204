"""A newcomer goes from the home page to credited work by following only what the pages show, timed.

She lands on the home page, picks the open campaign, signs up from its join
page, confirms her address and is back on the join page, logged in. She runs
the login and run commands the page shows (the repository's agent stands for
the installed one: the install step has its own test, which pip-installs the
site's wheel into a fresh environment), approves the device code the agent
prints, and watches her profile until credit appears. The time from landing
to first credit is printed as ``newcomer: landing_to_first_credit_s=...``.
"""

from __future__ import annotations

import re
import shlex
import time
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from tests.browser.live_site import LiveSite, Outbox, Shot
from tests.browser.live_training import running_tiny_gpt, training_swarm
from tests.browser.test_volunteer_joins import USER_CODE, VERIFICATION_URI, AgentCommand
from tests.factories import make_organizer

pytestmark = pytest.mark.timeout(300)
PASSWORD = "indigo-tensor-41"
CREDIT_S = 150.0  # the first committed step, on two busy cores, with the site, an aggregator and her agent


def _command(page: Page, what: str) -> list[str]:
    """The arguments of the Linux command the join page shows for ``what`` (after the agent's path)."""
    linux = page.locator('details[data-platform="linux"]')
    step = linux.locator("li", has_text=what).first
    words = shlex.split(step.locator("code").first.inner_text())
    assert words[0].endswith("crowdtrain-agent"), words
    return words[1:]


def test_a_newcomer_follows_the_pages_from_landing_to_credit(
    page: Page, shot: Shot, live_site: LiveSite, outbox: Outbox, tmp_path: Path
) -> None:
    campaign = running_tiny_gpt(live_site, make_organizer("olga"))
    config = tmp_path / "agent" / "config.json"
    agents: list[AgentCommand] = []
    with training_swarm(live_site, tmp_path / "swarm", campaign.pk, []):
        try:
            landed = time.monotonic()
            page.goto("/")
            page.get_by_role("link", name=f"Join {campaign.name}").click()
            join_url = page.url
            page.get_by_role("link", name="Sign up").click()
            page.get_by_label("Email").fill("hedy@example.org")
            page.get_by_label("Password:", exact=True).fill(PASSWORD)
            page.get_by_label("Password (again)").fill(PASSWORD)
            page.get_by_role("button", name="Sign Up").click()
            [confirm] = [link for link in outbox.newest(to="hedy@example.org").links if "/confirm-email/" in link][:1]
            page.goto(confirm)
            page.get_by_role("button", name="Confirm").click()
            expect(page).to_have_url(join_url)
            shot(page, "back on the join page")

            # The login command, as shown; she opens the address it prints and approves the code.
            login_args = _command(page, "Log this machine in")
            login = AgentCommand([*login_args, "--no-browser"], config)
            agents.append(login)
            uri = login.wait_for(VERIFICATION_URI, "verification address", 30).group(1)
            code = login.wait_for(USER_CODE, "user code", 30).group(1)
            page.goto(uri)
            page.get_by_label("Device code").fill(code)
            page.get_by_role("button", name="Continue").click()
            page.get_by_role("button", name="Approve").click()
            expect(page.get_by_role("heading", name="Device approved")).to_be_visible()
            assert login.finish(30) == 0, login.describe()

            # The run command, as shown, then her profile until credit shows.
            page.goto(join_url)
            run_args = _command(page, "Start computing")
            run = AgentCommand([*run_args, "--no-progress", "--threads", "1", "--cache-dir", str(tmp_path / "cache")],
                               config)  # fmt: skip
            agents.append(run)
            deadline = time.monotonic() + CREDIT_S
            credited = 0.0
            while time.monotonic() < deadline:
                page.goto("/me/")
                text = page.get_by_test_id("credit-total").inner_text().replace(",", "")
                credited = float(re.sub(r"[^0-9.]", "", text) or 0)
                if credited > 0:
                    break
                time.sleep(2.0)
            took = time.monotonic() - landed
            shot(page, "first credit")
            assert credited > 0, f"no credit within {CREDIT_S:.0f} s; {run.describe()}"
            print(f"\nnewcomer: landing_to_first_credit_s={took:.0f} credit={credited:g}")
        finally:
            for agent in agents:
                agent.stop()
