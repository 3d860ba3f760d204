"""Exporting a validated version: owner and staff download weights and config; everyone else gets nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from django.test import Client
from django.urls import reverse

from crowdtrain.campaigns import validation
from crowdtrain.campaigns.agent_wheel import agent_version
from crowdtrain.campaigns.models import Campaign
from crowdtrain.campaigns.tasks import compute_validation_loss
from crowdtrain.datasets.sharding import create_text_dataset
from crowdtrain_agent.models import get_model, load_exported
from tests.factories import logged_in, make_admin, make_campaign, make_organizer, make_volunteer

pytestmark = pytest.mark.django_db

SAMPLE_LEN = 9
TEXT = bytes((i * 5 + 1) % 253 for i in range(60 * SAMPLE_LEN))


@pytest.fixture
def campaign(monkeypatch: pytest.MonkeyPatch) -> Campaign:
    """Versions 10 and 20 validated; the aggregators answer with the seeded init plus the version."""

    def fetch(c: Campaign, version: int) -> torch.Tensor:
        model = get_model(c.architecture).build(c.model_config, seed=c.seed)
        return torch.nn.utils.parameters_to_vector(model.parameters()).detach() + version * 1e-3

    monkeypatch.setattr(validation, "fetch_campaign_params", fetch)
    dataset = create_text_dataset("export", TEXT, SAMPLE_LEN, shard_bytes=8 * SAMPLE_LEN, validation_fraction=0.25)
    c = make_campaign(dataset, seed=3)
    c.owner = make_organizer("owner")
    c.save(update_fields=["owner"])
    compute_validation_loss(c.pk, 10)
    compute_validation_loss(c.pk, 20)
    return c


def _get(client: Client, name: str, campaign: Campaign, version: object | None = None) -> object:
    url = reverse(name, args=[campaign.pk])
    return client.get(url, {"version": version} if version is not None else {})


def test_the_owner_downloads_a_version_that_loads_and_reproduces_its_validation_loss(
    campaign: Campaign, tmp_path: Path
) -> None:
    client = logged_in(campaign.owner)

    weights = _get(client, "campaign-export", campaign, 10)
    config = _get(client, "campaign-export-config", campaign, 10)

    assert weights.status_code == 200 and config.status_code == 200
    assert 'filename="model.safetensors"' in weights["Content-Disposition"]
    (tmp_path / "model.safetensors").write_bytes(b"".join(weights.streaming_content))
    (tmp_path / "config.json").write_bytes(config.content)
    model = load_exported(tmp_path / "model.safetensors", tmp_path / "config.json")
    meta = json.loads(config.content)
    loss, count = validation.mean_loss(get_model("gpt"), model, validation.validation_samples(campaign.dataset, 1024))
    assert meta["version"] == meta["step"] == 10 and meta["architecture"] == "gpt"
    assert meta["dataset"] == {"name": "export", "kind": "text", "sample_len": SAMPLE_LEN}
    assert count == meta["val_samples"] == 15
    assert loss == pytest.approx(meta["val_loss"], rel=1e-5)


def test_without_a_version_the_newest_export_is_served(campaign: Campaign) -> None:
    config = _get(logged_in(campaign.owner), "campaign-export-config", campaign)

    assert config.json()["version"] == 20


def test_staff_may_export_any_campaign(campaign: Campaign) -> None:
    response = _get(logged_in(make_admin()), "campaign-export", campaign, 20)

    assert response.status_code == 200


@pytest.mark.parametrize("persona", ["another organizer", "a volunteer"])
def test_nobody_else_learns_the_campaign_exists(campaign: Campaign, persona: str) -> None:
    user = make_organizer("stranger") if persona == "another organizer" else make_volunteer("volunteer")

    weights = _get(logged_in(user), "campaign-export", campaign, 10)
    config = _get(logged_in(user), "campaign-export-config", campaign, 10)

    assert weights.status_code == 404 and config.status_code == 404


def test_an_anonymous_visitor_is_sent_to_sign_in(campaign: Campaign) -> None:
    response = _get(logged_in(None), "campaign-export", campaign, 10)

    assert response.status_code == 302 and reverse("account_login") in response["Location"]


def test_a_version_that_is_not_a_number_is_refused(campaign: Campaign) -> None:
    response = _get(logged_in(campaign.owner), "campaign-export", campaign, "ten")

    assert response.status_code == 400
    assert response.json() == {"error": "version must be an integer, got 'ten'"}


def test_a_version_without_stored_weights_names_the_ones_there_are(campaign: Campaign) -> None:
    response = _get(logged_in(campaign.owner), "campaign-export-config", campaign, 15)

    assert response.status_code == 404
    assert response.json() == {"error": "version 15 was not exported; exported versions: 20, 10"}


def test_a_campaign_with_nothing_validated_has_nothing_to_export() -> None:
    c = make_campaign()
    c.owner = make_organizer("owner")
    c.save(update_fields=["owner"])

    response = _get(logged_in(c.owner), "campaign-export", c)

    assert response.status_code == 404 and "nothing to export yet" in response.json()["error"]


def test_the_campaign_page_shows_the_snippet_and_the_download_links(campaign: Campaign) -> None:
    page = logged_in(campaign.owner).get(reverse("campaign-detail", args=[campaign.pk]))

    html = page.content.decode()
    assert page.status_code == 200
    assert "from crowdtrain_agent.models import load_exported" in html
    # Installed as the join page installs it: no package index serves crowdtrain-agent.
    assert "pip install crowdtrain-agent" not in html
    assert f"# pip install http://testserver/agent/crowdtrain_agent-{agent_version()}-py3-none-any.whl" in html
    assert f"{reverse('campaign-export', args=[campaign.pk])}?version=10" in html
    assert f"{reverse('campaign-export-config', args=[campaign.pk])}?version=20" in html
