"""An organizer uploads a pretrained model's folder in Chromium, waits for it to be checked, and starts a
campaign from it: choosing the weights fills in their architecture and sizes."""

from __future__ import annotations

import zipfile
from pathlib import Path

import torch
from playwright.sync_api import Page, expect

from crowdtrain.campaigns.models import Campaign
from crowdtrain.datasets.models import Dataset, Pretrained
from crowdtrain_agent.models.hf import library
from tests.browser.live_site import Shot, log_in
from tests.factories import make_organizer, make_text_dataset


def _zipped_llama(tmp_path: Path) -> Path:
    torch.manual_seed(3)
    config = library("LlamaConfig")(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    library("LlamaForCausalLM")(config).save_pretrained(tmp_path / "tiny-llama")
    archive = tmp_path / "tiny-llama.zip"
    with zipfile.ZipFile(archive, "w") as out:
        for path in (tmp_path / "tiny-llama").iterdir():
            out.write(path, f"tiny-llama/{path.name}")
    return archive


def test_uploaded_weights_become_the_start_of_a_campaign(page: Page, shot: Shot, tmp_path: Path) -> None:
    olga = make_organizer("olga")
    dataset = make_text_dataset()  # 9-byte samples: block_size 8
    Dataset.objects.filter(pk=dataset.pk).update(owner=olga, name="tiny bytes")
    log_in(page, "olga@example.org")

    page.goto("/datasets/")
    page.get_by_role("link", name="Upload pretrained weights").click()
    page.get_by_label("Zipped folder").set_input_files(_zipped_llama(tmp_path))
    page.get_by_role("button", name="Upload").click()
    expect(page.locator("[data-dataset-status] [data-field=status]")).to_have_text("ready", timeout=60_000)
    expect(page.locator("[data-field=architecture]")).to_have_text("llama")
    shot(page, "weights ready")

    page.get_by_role("link", name="Create a campaign from them").click()
    page.get_by_label("Name").fill("Fine-tuned llama")
    page.get_by_label("Dataset").select_option(label="tiny bytes (text, 100 samples, 9-byte samples)")
    weights = Pretrained.objects.get()
    page.get_by_label("Start from").select_option(label=f"tiny-llama (llama, {weights.param_count:,} parameters)")
    llama = page.locator('fieldset[data-architecture="llama"]')
    expect(page.get_by_label("Architecture")).to_have_value("llama")
    expect(llama).to_be_visible()
    expect(llama.get_by_label("hidden_size")).to_have_value("32")
    expect(llama.get_by_label("block_size")).to_have_value("256")
    llama.get_by_label("block_size").fill("8")  # RoPE: a shorter context keeps the weights' shapes
    page.get_by_label("Target batch size").fill("8")
    page.get_by_label("Microbatch size").fill("4")
    page.get_by_label("Max steps").fill("3")
    page.get_by_role("button", name="Create campaign").click()

    expect(page.get_by_test_id("state")).to_have_text("draft")
    shot(page, "campaign from weights")
    campaign = Campaign.objects.get()
    assert campaign.pretrained == weights and campaign.model_config["hidden_size"] == 32
