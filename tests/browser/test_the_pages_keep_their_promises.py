"""What the pages promise, they keep: a way in that works, a contact, honest install sizes, plain labels (issue 34).

Seen by newcomers in Chromium: a join page that linked an agent package the
site had not built (pip: "too many 503 error responses"); "contact us" with no
contact anywhere; "opens your browser" on a headless machine; pip pulling
PyTorch with no word of its size; "spare GPUs" in the footer of a CPU demo;
an export card telling organizers to install a package no index serves; a
confirmation page naming a made-up username; /favicon.ico answering 404 on
every page; raw ``n_layer`` labels; an empty box for a chart before any credit.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from playwright.sync_api import Page, Response, expect

from crowdtrain.campaigns.agent_wheel import wheel_name
from crowdtrain.campaigns.models import ValidationResult
from tests.browser.conftest import CONTACT_EMAIL
from tests.browser.live_site import LiveSite, Outbox, Shot, log_in
from tests.factories import make_campaign, make_organizer, make_volunteer

pytestmark = pytest.mark.timeout(150)
PASSWORD = "indigo-tensor-41"
PIP_URL = re.compile(r"pip(?:\.exe)? install (https?://\S+)")


def _wheel(live_site: LiveSite) -> Path:
    """The wheel the session's site serves (``manage.py build_agent_wheel`` made it under its var folder)."""
    return live_site.swarm.run_dir / "var" / "agent" / wheel_name()


def _commands(page: Page) -> list[str]:
    return [text.strip() for text in page.locator(".join-steps pre code").all_inner_texts()]


def test_the_join_page_never_links_an_agent_the_site_cannot_serve(page: Page, shot: Shot, live_site: LiveSite) -> None:
    campaign = make_campaign()
    wheel = _wheel(live_site)
    aside = wheel.with_suffix(".aside")
    shutil.move(wheel, aside)  # a site started without `manage.py serve`'s build, as a deployment might be
    try:
        page.goto(f"{live_site.url}/campaigns/{campaign.pk}/join")
        expect(page.get_by_test_id("wheel-missing").first).to_contain_text("manage.py build_agent_wheel")
        commands = _commands(page)
        assert not [c for c in commands if ".whl" in c], f"a link to the missing wheel is still shown: {commands}"
        assert "~/crowdtrain-agent/bin/pip install ./agent" in commands, commands
        shot(page, "no wheel: install from the source")
    finally:
        shutil.move(aside, wheel)

    page.reload()
    expect(page.get_by_test_id("wheel-missing")).to_have_count(0)
    urls = {match.group(1) for c in _commands(page) if (match := PIP_URL.search(c)) and match.group(1).endswith(".whl")}
    assert urls, f"no wheel link once the site has one: {_commands(page)}"
    for url in urls:  # what pip would fetch, from the page as shown: every one answers with the wheel
        answer = page.request.get(url)
        assert answer.status == 200 and answer.body()[:2] == b"PK", (url, answer.status)


def test_signing_up_shows_a_contact_and_confirming_names_the_address_only(
    page: Page, shot: Shot, live_site: LiveSite, outbox: Outbox
) -> None:
    page.goto(f"{live_site.url}/accounts/signup/")
    page.get_by_label("Email").fill("grace@example.org")
    page.get_by_label("Password:", exact=True).fill(PASSWORD)
    page.get_by_label("Password (again)").fill(PASSWORD)
    page.get_by_role("button", name="Sign Up").click()

    contact = page.get_by_test_id("contact")
    expect(contact).to_have_text(CONTACT_EMAIL)
    expect(contact).to_have_attribute("href", f"mailto:{CONTACT_EMAIL}")
    shot(page, "verification sent, with a contact")

    [confirm] = [link for link in outbox.newest(to="grace@example.org").links if "/accounts/confirm-email/" in link]
    page.goto(confirm)
    main = page.locator("main")
    expect(main).to_contain_text("Please confirm that grace@example.org is an email address of yours.")
    expect(main).not_to_contain_text("for user")


def test_the_join_page_says_what_pytorch_costs_and_how_to_log_in_without_a_browser(
    page: Page, live_site: LiveSite
) -> None:
    campaign = make_campaign()
    page.goto(f"{live_site.url}/campaigns/{campaign.pk}/join")
    linux = page.locator('details[data-platform="linux"]')
    linux.locator("summary").click() if linux.get_attribute("open") is None else None

    expect(linux).to_contain_text(re.compile(r"CPU build \(about \d+ MB\)"))
    expect(linux).to_contain_text(re.compile(r"CUDA build for an NVIDIA GPU \(about \d+ GB"))
    assert "~/crowdtrain-agent/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu" in _commands(
        page
    )
    expect(linux).to_contain_text("without one, open the link it prints on any device")
    expect(page.locator("footer")).to_contain_text("spare CPUs and GPUs")


def test_no_page_asks_for_a_file_the_site_lacks_and_the_icon_is_there(page: Page, live_site: LiveSite) -> None:
    campaign = make_campaign()
    make_volunteer("ada")
    missing: list[str] = []

    def note(response: Response) -> None:
        if response.url.startswith(live_site.url) and response.status == 404:
            missing.append(response.url)

    page.on("response", note)
    log_in(page, "ada@example.org")
    for path in ("/", f"/campaigns/{campaign.pk}/", f"/campaigns/{campaign.pk}/join", "/leaderboards/", "/me/"):
        page.goto(f"{live_site.url}{path}")
        page.wait_for_load_state("networkidle")
    icon = page.request.get(f"{live_site.url}/favicon.ico")

    assert missing == [], f"pages asked for files the site does not have: {missing}"
    assert icon.status == 200 and icon.headers["content-type"].startswith("image/"), icon.headers
    # Before any credit, the chart says so instead of drawing an empty box.
    expect(page.get_by_test_id("credit-chart-empty")).to_be_visible()
    expect(page.get_by_test_id("credit-chart")).to_have_count(0)


def test_the_organizers_pages_speak_words_and_export_what_pip_can_fetch(
    page: Page, shot: Shot, live_site: LiveSite
) -> None:
    owner = make_organizer("olga")
    campaign = make_campaign()
    campaign.owner = owner
    campaign.save(update_fields=["owner"])
    ValidationResult.objects.create(campaign=campaign, version=10, loss=1.5, num_samples=20, weights="v10.safetensors")
    log_in(page, "olga@example.org")

    page.goto(f"{live_site.url}/campaigns/{campaign.pk}/")
    snippet = page.get_by_test_id("export-snippet").inner_text()
    assert "pip install crowdtrain-agent" not in snippet
    [url] = PIP_URL.findall(snippet)
    answer = page.request.get(url)
    assert answer.status == 200 and answer.body()[:2] == b"PK", (url, answer.status)
    expect(page.get_by_test_id("coverage")).to_contain_text("Samples in each state, over all shards")
    shot(page, "export card")

    page.goto(f"{live_site.url}/campaigns/new")
    labels = [text.strip() for text in page.locator("fieldset label").all_text_contents() if text.strip()]
    assert labels, "the campaign form shows no model settings"
    raw = [label for label in labels if "_" in label.split("(")[0]]
    assert raw == [], f"model settings labelled by their config names only: {raw}"
    assert any(re.fullmatch(r"[A-Z][^_(]+ \(n_layer\):?", label) for label in labels), labels
