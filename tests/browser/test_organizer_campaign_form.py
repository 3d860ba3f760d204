"""An organizer fills in the campaign form in Chromium (fields follow the architecture), then drives its lifecycle."""

from __future__ import annotations

from playwright.sync_api import Page, expect

from crowdtrain.campaigns.models import Campaign, Step, ValidationResult
from crowdtrain.datasets.models import Dataset
from tests.browser.live_site import Shot, log_in
from tests.factories import make_organizer, make_text_dataset


def test_an_organizer_creates_a_campaign_and_moves_it_through_its_life(page: Page, shot: Shot) -> None:
    olga = make_organizer("olga")
    dataset = make_text_dataset()  # 9-byte samples: block_size 8
    Dataset.objects.filter(pk=dataset.pk).update(owner=olga, name="tiny bytes")
    log_in(page, "olga@example.org")

    # The form shows the chosen architecture's fields only, and swaps them on change.
    page.get_by_role("link", name="Organize").click()
    page.get_by_role("link", name="New campaign").click()
    gpt, mlp = page.locator('fieldset[data-architecture="gpt"]'), page.locator('fieldset[data-architecture="mlp"]')
    expect(gpt).to_be_visible()
    expect(mlp).to_be_hidden()
    page.get_by_label("Architecture").select_option("mlp")
    expect(mlp).to_be_visible()
    expect(gpt).to_be_hidden()
    page.get_by_label("Architecture").select_option("gpt")
    page.locator("select[name=optimizer]").select_option("sgd")
    expect(page.get_by_label("Momentum")).to_be_visible()
    expect(page.get_by_label("beta1")).to_be_hidden()
    page.locator("select[name=optimizer]").select_option("adamw")

    # A bad value comes back next to its field, and nothing is saved.
    page.get_by_label("Name").fill("Tiny GPT")
    page.get_by_label("Dataset").select_option(label="tiny bytes (text, 100 samples, 9-byte samples)")
    for name, value in {"n_layer": "1", "n_head": "1", "n_embd": "8", "block_size": "8"}.items():
        gpt.get_by_label(name).fill(value)
    page.get_by_label("Learning rate:", exact=True).fill("0")
    page.get_by_label("Target batch size").fill("8")
    page.get_by_label("Microbatch size").fill("4")
    page.get_by_label("Max steps").fill("3")
    page.get_by_role("button", name="Create campaign").click()
    expect(page.locator('[data-field="lr"] .errorlist')).to_contain_text("Learning rate (optimizer.lr) must be above 0")
    shot(page, "inline error")
    assert not Campaign.objects.exists()

    page.get_by_label("Learning rate:", exact=True).fill("0.003")
    page.get_by_role("button", name="Create campaign").click()
    expect(page.get_by_test_id("state")).to_have_text("draft")
    shot(page, "draft")
    campaign = Campaign.objects.get()

    page.get_by_test_id("action-start").click()
    expect(page.get_by_test_id("state")).to_have_text("running")
    # no aggregator in this test: the page says so instead of a bare RUNNING
    expect(page.get_by_test_id("condition")).to_have_attribute("data-code", "waiting_for_aggregators")
    expect(page.get_by_test_id("condition")).to_contain_text("Waiting for aggregators: 0 of 1 slice ready")

    # Progress arrives through the feed: the page redraws the chart without a reload.
    for index, loss in enumerate([5.0, 4.0]):
        Step.objects.create(campaign=campaign, index=index, num_samples=8, loss_sum=8 * loss)
    ValidationResult.objects.create(campaign=campaign, version=2, loss=4.25, num_samples=10)
    Campaign.objects.filter(pk=campaign.pk).update(committed_steps=2)
    expect(page.locator('[data-stat="committed_steps"]')).to_have_text("2", timeout=15_000)
    expect(page.locator('[data-stat="train_loss"]')).to_have_text("4.000")
    expect(page.locator('[data-stat="val_loss"]')).to_have_text("4.250")
    # Both curves on the step axis (steps 1 and 2, the validation point at 2) and on the time axis.
    expect(page.get_by_test_id("chart-loss-step")).to_have_attribute("data-points", "2")
    expect(page.get_by_test_id("chart-loss-time")).not_to_have_attribute("data-points", "0")
    expect(page.get_by_test_id("chart-loss-step").get_by_test_id("chart-empty")).to_be_hidden()
    shot(page, "running")

    page.get_by_role("link", name="Edit").click()
    expect(page.get_by_test_id("lock-reason")).to_contain_text("would break the model")
    expect(gpt.get_by_label("n_embd")).to_be_disabled()
    page.get_by_label("Max steps").fill("5")
    page.get_by_role("button", name="Save changes").click()
    shot(page, "edited")

    for action, state in [("pause", "paused"), ("resume", "running"), ("finish", "finished"), ("archive", "archived")]:
        page.get_by_test_id(f"action-{action}").click()
        if action in ("finish", "archive"):  # neither can be undone: a page asks first
            expect(page.get_by_test_id("confirm-move")).to_contain_text("This cannot be undone.")
            page.get_by_test_id(f"confirm-{action}").click()
        expect(page.get_by_test_id("state")).to_have_text(state)
        if state == "finished":  # no live rate for a model that no longer trains
            expect(page.get_by_text("Samples/s now")).to_have_count(0)
            expect(page.get_by_text("Average samples/s")).to_be_visible()
    shot(page, "archived")
    campaign.refresh_from_db()
    assert campaign.state == Campaign.State.ARCHIVED and campaign.max_steps == 5
