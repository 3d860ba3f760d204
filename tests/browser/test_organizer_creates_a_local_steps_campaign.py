"""An organizer makes a local-steps (DiLoCo) campaign in Chromium: the inner optimizer's fields come with the mode.

The inner settings show only once Training mode is local, and choosing it
sets the check fraction to the 0 local mode needs (the staleness keeps its
default of 1: overlapped rounds); a check
fraction set again is refused with a message saying why local leases cannot
be verified by a copy, and the campaign page then names the mode.
"""

from __future__ import annotations

from playwright.sync_api import Page, expect

from crowdtrain.campaigns.models import Campaign
from crowdtrain.datasets.models import Dataset
from tests.browser.live_site import Shot, log_in
from tests.factories import make_organizer, make_text_dataset


def test_an_organizer_creates_a_local_steps_campaign(page: Page, shot: Shot) -> None:
    olga = make_organizer("olga")
    dataset = make_text_dataset()  # 9-byte samples: block_size 8
    Dataset.objects.filter(pk=dataset.pk).update(owner=olga, name="tiny bytes")
    log_in(page, "olga@example.org")

    page.goto("/campaigns/new")
    inner_lr = page.get_by_label("Inner learning rate")
    expect(inner_lr).to_be_hidden()  # sync is the default: no inner optimizer
    page.locator("select[name=training_mode]").select_option("local")
    expect(inner_lr).to_be_visible()
    expect(page.get_by_label("Inner optimizer")).to_have_value("adamw")

    page.get_by_label("Name").fill("Tiny GPT, local steps")
    page.get_by_label("Dataset").select_option(label="tiny bytes (text, 100 samples, 9-byte samples)")
    gpt = page.locator('fieldset[data-architecture="gpt"]')
    for name, value in {"n_layer": "1", "n_head": "1", "n_embd": "8", "block_size": "8"}.items():
        gpt.get_by_label(name).fill(value)
    # The outer optimizer: SGD with Nesterov momentum, as in the DiLoCo papers.
    page.locator("select[name=optimizer]").select_option("sgd")
    page.locator("input[name=lr]").fill("0.7")
    page.get_by_label("Momentum").fill("0.9")
    page.get_by_label("Nesterov").check()
    inner_lr.fill("0.002")
    page.get_by_label("Target batch size").fill("32")
    page.get_by_label("Microbatch size").fill("4")
    page.get_by_label("Max steps").fill("10")
    # Choosing local mode moved the check fraction from its default to the 0 it needs; staleness 1 overlaps rounds.
    expect(page.locator("input[name=staleness]")).to_have_value("1")
    expect(page.locator("input[name=check_fraction]")).to_have_value("0")
    page.locator("summary", has_text="Robustness").click()
    page.locator("input[name=check_fraction]").fill("0.05")  # an organizer who wants checks anyway
    page.get_by_role("button", name="Create campaign").click()

    error = page.locator('[data-field="check_fraction"] .errorlist')
    expect(error).to_contain_text("local mode cannot verify leases by a second copy")
    expect(error).to_be_visible()  # its folded group opens to show it
    expect(inner_lr).to_be_visible()  # the mode chosen is kept, and so its fields
    shot(page, "check fraction refused")
    assert not Campaign.objects.exists()

    page.get_by_label("Check fraction").fill("0")
    page.get_by_role("button", name="Create campaign").click()
    expect(page.get_by_test_id("state")).to_have_text("draft")
    campaign = Campaign.objects.get()
    assert (campaign.training_mode, campaign.inner_optimizer, campaign.inner_lr) == ("local", "adamw", 0.002)
    assert campaign.staleness == 1
    assert campaign.optimizer["name"] == "sgd" and campaign.optimizer["nesterov"] is True
    expect(page.locator('[data-live="network.training_mode_text"]')).to_contain_text("local")
    shot(page, "local campaign")
