"""Every page a newcomer, a volunteer, an organizer and an admin reach fits a 390 px phone: no sideways scrolling.

Each page is opened at 390 px and photographed (test-artifacts/browser/); the test fails listing every page
whose document is wider than the screen, with the elements that stick out, so the fix is in sight.
"""

from __future__ import annotations

from typing import Any

from playwright.sync_api import Page, expect

from crowdtrain.campaigns.models import Campaign, OrganizerRequest
from crowdtrain.datasets.models import Dataset
from tests.browser.live_site import LiveSite, Shot, log_in
from tests.factories import make_admin, make_campaign, make_organizer, make_volunteer

PHONE = {"width": 390, "height": 844}
# The elements whose right edge passes the screen's, innermost first, as "tag.class (right edge)".
STICKING_OUT = """() => {
  const width = document.documentElement.clientWidth;
  const out = [];
  for (const el of document.querySelectorAll("body *")) {
    const box = el.getBoundingClientRect();
    if (box.right > width + 0.5 && !Array.from(el.children).some(c => c.getBoundingClientRect().right > width + 0.5))
      out.push(`${el.tagName.toLowerCase()}${el.className ? "." + String(el.className).split(" ").join(".") : ""}`
               + ` (${Math.round(box.right)})`);
  }
  return out.slice(0, 5);
}"""


def _seed() -> dict[str, Any]:
    organizer = make_organizer("olga")
    campaign = make_campaign()
    Campaign.objects.filter(pk=campaign.pk).update(owner=organizer, name="Shakespeare GPT, a long campaign name")
    Dataset.objects.filter(pk=campaign.dataset_id).update(owner=organizer)
    make_volunteer("vera")
    OrganizerRequest.objects.create(user=make_volunteer("max"), reason="A small GPT for my class.")
    make_admin("ada")
    return {"campaign": campaign.pk, "dataset": campaign.dataset_id}


def _overflow(page: Page, shot: Shot, who: str, path: str) -> str | None:
    page.goto(path)
    page.wait_for_load_state("load")
    width = page.evaluate("document.documentElement.scrollWidth")
    shot(page, f"{who} {path}")
    if width <= PHONE["width"]:
        return None
    return f"{who} {path}: {width} px wide; sticking out: {', '.join(page.evaluate(STICKING_OUT))}"


def test_every_page_fits_390_px(page: Page, shot: Shot, live_site: LiveSite) -> None:
    ids = _seed()
    page.set_viewport_size(PHONE)
    c, d = ids["campaign"], ids["dataset"]
    tours = {
        "newcomer": ["/", "/leaderboards/", f"/campaigns/{c}/join", "/accounts/login/", "/accounts/signup/"],
        "vera@example.org": ["/", "/devices/", "/me/", "/teams/", "/teams/new", "/account/standing/",
                             f"/campaigns/{c}/join", "/campaigns/new", "/organizers/request", "/device"],
        "olga@example.org": ["/campaigns/", f"/campaigns/{c}/", f"/campaigns/{c}/edit", "/campaigns/new",
                             "/datasets/", "/datasets/new", f"/datasets/{d}/"],
        "ada@example.org": ["/staff/review/", "/organizers/requests", f"/campaigns/{c}/", "/leaderboards/",
                            "/dashboard/"],
    }  # fmt: skip
    too_wide = []

    for who, paths in tours.items():
        page.context.clear_cookies()
        if who != "newcomer":
            log_in(page, who)
        too_wide += [found for path in paths if (found := _overflow(page, shot, who, path))]

    assert not too_wide, "pages wider than a 390 px phone:\n" + "\n".join(too_wide)


# Install commands whose text is cut off inside their box, as "command (shown of full px)".
CUT_COMMANDS = """() => Array.from(document.querySelectorAll(".command pre"))
  .filter(pre => pre.scrollWidth > pre.clientWidth + 1 && pre.closest("details[open]"))
  .map(pre => `${pre.textContent.trim().slice(0, 60)} (${pre.clientWidth} of ${pre.scrollWidth} px)`)"""


def test_install_commands_are_shown_whole_on_a_phone_and_a_desktop(page: Page, shot: Shot) -> None:
    # Issue 34: at 390 px each command box showed some 20 characters; on a desktop the pip command was cut off.
    campaign = make_campaign()
    for width, height in ((390, 844), (1280, 800)):
        page.set_viewport_size({"width": width, "height": height})
        page.goto(f"/campaigns/{campaign.pk}/join")
        for details in page.locator("details.join-platform").all():
            details.evaluate("node => { node.open = true; }")
        shot(page, f"join page at {width} px")
        assert page.evaluate(CUT_COMMANDS) == [], f"commands cut off at {width} px"
        assert page.evaluate("document.documentElement.scrollWidth") <= width


def test_a_newcomer_reaches_the_join_instructions_in_one_click(page: Page, shot: Shot) -> None:
    campaign = make_campaign()
    page.set_viewport_size(PHONE)

    page.goto("/")
    expect(page.get_by_test_id("what-crowdtrain-is")).to_contain_text("volunteers lend")
    shot(page, "home page")
    page.get_by_role("link", name=f"Join {campaign.name}").click()

    expect(page.get_by_role("heading", name=f"Join {campaign.name}", level=1)).to_be_visible()
    expect(page.get_by_text("/agent/crowdtrain_agent-").first).to_be_visible()
    shot(page, "join instructions")
