"""An organizer runs a campaign end to end in Chromium: upload, form, real aggregator and agents, pause, finish, export.

Issue 4's acceptance scenario as a person does it: Olga uploads a slice of
the Python standard library, creates a tiny byte-level GPT campaign in the
form, starts it, and watches two volunteers' real agents (CPU, one thread
each) train it through a real backbone aggregator. She pauses, resumes and
finishes it, then downloads the model from the export card; the test loads
it with ``load_exported`` and recomputes its held-out loss with plain PyTorch.

The form has no "validate every" field: campaigns validate every 10 steps
(the model's default) and at the finish, so the run goes past step 10 for a
validation loss to appear while it trains. Two agents make 25 to 40 steps a
second here, so ``max_steps`` is far above what the test reaches: Finish is
Olga's click, not the stop rule's.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch
from playwright.sync_api import Page, expect
from torch.nn import functional as F

from crowdtrain.accounts.models import Device
from crowdtrain.campaigns.models import Campaign, ValidationResult
from crowdtrain.datasets.models import Dataset
from crowdtrain.datasets.sharding import stdlib_corpus
from crowdtrain.scheduler.models import Lease
from crowdtrain_agent.models import load_exported
from crowdtrain_launcher import Swarm
from tests.browser.live_site import LiveSite, Shot, log_in
from tests.browser.live_training import training_swarm
from tests.factories import make_organizer, make_volunteer

pytestmark = pytest.mark.timeout(180)

CORPUS_BYTES = 40 << 10
MODEL = {"n_layer": "1", "n_head": "1", "n_embd": "16", "block_size": "16"}
SAMPLE_LEN = 17  # block_size + 1: the input bytes and the next byte of the last one
VALIDATE_EVERY = 10  # Campaign.validate_every's default; the form does not set it
MAX_STEPS = 100_000
TRAINING_MS = 60_000  # a generous bound: the first step usually comes some 5 s after the agents start


def wait_until_drained(campaign: Campaign, timeout_s: float = 30.0) -> int:
    """Once paused, leases already out come back and count; return the committed steps once none is out."""
    deadline = time.monotonic() + timeout_s
    while campaign.leases.filter(state=Lease.State.ACTIVE).exists():
        if time.monotonic() > deadline:
            pytest.fail(f"leases of the paused campaign still out after {timeout_s:.0f} s")
        time.sleep(0.2)
    campaign.refresh_from_db()
    return campaign.committed_steps


def wait_for_final_export(campaign: Campaign, swarm: Swarm, timeout_s: float = 30.0) -> ValidationResult:
    """The export of the version the campaign ended with, once no lease is out and every committed step is applied.

    Finishing validates the last version in the background, and so does the
    aggregator applying a step that was committed before the click.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        swarm.check()
        campaign.refresh_from_db()
        settled = (
            campaign.version == campaign.committed_steps
            and not campaign.leases.filter(state=Lease.State.ACTIVE).exists()
        )
        result = campaign.validation_results.filter(version=campaign.version).exclude(weights="").first()
        if settled and result is not None and result.loss is not None:
            return result
        if time.monotonic() > deadline:
            pytest.fail(
                f"no export of version {campaign.version} ({campaign.committed_steps} steps committed) "
                f"{timeout_s:.0f} s after the finish"
            )
        time.sleep(0.2)


def held_out_loss(model: torch.nn.Module, corpus: bytes, dataset: Dataset) -> float:
    """Plain PyTorch over the held-out split, rebuilt from the uploaded bytes: the samples after the training ones."""
    train, held_out = dataset.num_samples, dataset.num_validation_samples
    rows = bytearray(corpus[train * SAMPLE_LEN : (train + held_out) * SAMPLE_LEN])
    tokens = torch.frombuffer(rows, dtype=torch.uint8).view(held_out, SAMPLE_LEN).long()
    with torch.no_grad():
        logits = model(tokens[:, :-1])
        total = float(F.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1), reduction="sum"))
    return total / (held_out * (SAMPLE_LEN - 1))


def test_an_organizer_trains_a_tiny_gpt_with_real_agents_and_downloads_it(
    page: Page, shot: Shot, live_site: LiveSite, tmp_path: Path
) -> None:
    make_organizer("olga")
    # Two volunteers' machines; their agents log in with these device tokens.
    agent_tokens = [Device.issue(make_volunteer(name), f"{name}-laptop")[1] for name in ("vera", "victor")]
    corpus = stdlib_corpus(CORPUS_BYTES)
    upload = tmp_path / "stdlib.txt"
    upload.write_bytes(corpus)
    log_in(page, "olga@example.org")

    # She uploads the text with one sample per block_size + 1 bytes and watches it split into shards.
    page.goto("/datasets/new")
    page.get_by_label("File").set_input_files(upload)
    page.get_by_label("Name").fill("stdlib source")
    page.get_by_label("Sample length (bytes)").fill(str(SAMPLE_LEN))
    page.get_by_role("button", name="Upload").click()
    expect(page.locator("[data-dataset-status] [data-field=status]")).to_have_text("ready")
    dataset = Dataset.objects.get(name="stdlib source")
    expect(page.locator("[data-field=num_validation_samples]")).to_have_text(str(dataset.num_validation_samples))
    shot(page, "dataset ready")

    # The campaign form: a tiny GPT, AdamW with one warmup step and a cosine decay, small batches.
    page.get_by_role("link", name="Create a campaign").click()
    page.get_by_label("Name").fill("stdlib GPT")
    page.get_by_label("Dataset").select_option(
        label=f"stdlib source (text, {dataset.num_samples} samples, {SAMPLE_LEN}-byte samples)"
    )
    page.get_by_label("Architecture").select_option("gpt")
    gpt = page.locator('fieldset[data-architecture="gpt"]')
    for name, value in MODEL.items():
        gpt.get_by_label(name).fill(value)
    page.locator("select[name=optimizer]").select_option("adamw")
    page.get_by_label("Learning rate:", exact=True).fill("0.01")
    page.get_by_label("Warmup steps").fill("1")
    page.get_by_label("Schedule:", exact=True).select_option("cosine")
    page.get_by_label("Minimum LR ratio").fill("0.1")
    page.get_by_label("Target batch size").fill("32")
    page.get_by_label("Microbatch size").fill("16")
    page.get_by_label("Max steps").fill(str(MAX_STEPS))
    shot(page, "campaign form")
    page.get_by_role("button", name="Create campaign").click()
    expect(page.get_by_test_id("state")).to_have_text("draft")
    shot(page, "campaign created")
    campaign = Campaign.objects.get(name="stdlib GPT")
    assert campaign.optimizer["schedule"] == "cosine" and campaign.optimizer["total_steps"] == MAX_STEPS
    assert campaign.validate_every == VALIDATE_EVERY

    page.get_by_test_id("action-start").click()
    expect(page.get_by_test_id("state")).to_have_text("running")
    condition = page.get_by_test_id("condition")
    expect(condition).to_have_attribute("data-code", "waiting_for_aggregators")

    with training_swarm(live_site, tmp_path / "swarm", campaign.pk, agent_tokens) as swarm:
        # Steps advance on the page, and the held-out loss of version 10 shows up while it trains.
        steps = page.locator('[data-stat="committed_steps"]')
        expect(steps).not_to_have_text("0", timeout=TRAINING_MS)
        expect(condition).to_have_attribute("data-code", "training")  # live, without a reload
        expect(page.locator('[data-stat="val_loss"]')).to_have_text(re.compile(r"^\d+\.\d{3}$"), timeout=TRAINING_MS)
        expect(page.locator('[data-stat="contributors"]')).to_have_text("2", timeout=TRAINING_MS)
        expect(page.get_by_test_id("chart-loss-step")).not_to_have_attribute("data-points", "0")
        expect(page.get_by_test_id("chart-throughput")).not_to_have_attribute("data-points", "0")
        expect(page.get_by_test_id("contributors").locator("tbody tr")).to_have_count(2)
        # The coverage map: squares for the epoch's shards, some with committed work, and the numbers on select.
        # A square's colour (data-state) is its largest share, and two agents run through this small dataset's
        # epoch in seconds, so done work need not be any square's largest share when the map polls (CI caught
        # that); the label lists every state the square has samples in.
        done_square = page.locator('#coverage-map button:is([aria-label*=" done"], [aria-label*=" verified"])').first
        expect(done_square).to_be_visible(timeout=TRAINING_MS)
        done_square.click()
        expect(page.locator("[data-coverage-details]")).to_contain_text(re.compile(r"\d done|\d verified"))
        # validated weights become downloadable on the open page, without a reload (the newest ones:
        # older versions' weights are pruned as training runs on, so version 10's may be gone already)
        expect(page.locator('[data-testid^="export-weights-"]').first).to_be_visible(timeout=TRAINING_MS)
        shot(page, "training with a validation loss")

        # Paused: the leases already out come back, then the step count stands still.
        page.get_by_test_id("action-pause").click()
        expect(page.get_by_test_id("state")).to_have_text("paused")
        paused_at = wait_until_drained(campaign)
        time.sleep(4)  # longer than an agent's retry (2 s) and the page's poll (3 s)
        campaign.refresh_from_db()
        assert campaign.committed_steps == paused_at, "steps were committed while the campaign was paused"
        expect(steps).to_have_text(str(paused_at))
        shot(page, "paused")

        page.get_by_test_id("action-resume").click()
        expect(page.get_by_test_id("state")).to_have_text("running")
        expect(steps).not_to_have_text(str(paused_at), timeout=TRAINING_MS)
        shot(page, "resumed")

        page.get_by_test_id("action-finish").click()
        page.get_by_test_id("confirm-finish").click()  # it cannot be undone: the site asks first
        expect(page.get_by_test_id("state")).to_have_text("finished")
        final = wait_for_final_export(campaign, swarm)

    # The export card lists the last version with its loss; she downloads both files.
    page.reload()
    expect(page.locator('[data-stat="val_loss"]')).to_have_text(f"{final.loss:.3f}")
    weights_link = page.get_by_test_id(f"export-weights-{final.version}")
    expect(page.get_by_role("row", name=re.compile(rf"^{final.version} "))).to_contain_text(f"{final.loss:.4f}")
    shot(page, "finished with exports")
    with page.expect_download() as weights_download:
        weights_link.click()
    weights_download.value.save_as(tmp_path / "model.safetensors")
    with page.expect_download() as config_download:
        page.get_by_test_id(f"export-config-{final.version}").click()
    config_download.value.save_as(tmp_path / "config.json")

    model = load_exported(tmp_path / "model.safetensors", tmp_path / "config.json")
    config = json.loads((tmp_path / "config.json").read_text())
    loss = held_out_loss(model, corpus, dataset)
    campaign.refresh_from_db()
    assert campaign.state == Campaign.State.FINISHED
    assert paused_at < final.version < MAX_STEPS, "finished by hand after the resume, before the stop rule"
    assert campaign.validation_results.filter(version=VALIDATE_EVERY, loss__isnull=False).exists()
    assert weights_download.value.suggested_filename == "model.safetensors"
    assert config["version"] == final.version and config["model_config"]["n_embd"] == 16
    assert config["val_samples"] == dataset.num_validation_samples
    assert abs(loss - final.loss) <= 1e-5 * abs(final.loss), "the downloaded model does not give the shown loss"
    assert loss < 5.0, "the model learned nothing: a byte-level model starts near ln(256) = 5.55"
