"""One table declares each campaign setting: the form, the lock list, the detail page and the aggregators follow it."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib import admin
from django.contrib.auth.models import AbstractBaseUser
from django.test import Client

from crowdtrain.campaigns.admin import CampaignAdminForm
from crowdtrain.campaigns.lifecycle import LOCKED_FIELDS
from crowdtrain.campaigns.management.commands.seed_run import CAMPAIGN_FIELDS
from crowdtrain.campaigns.models import Campaign
from crowdtrain.campaigns.settings_table import SETTINGS
from crowdtrain.campaigns.setup import CampaignConfigError, create_campaign
from crowdtrain.datasets.models import Dataset
from crowdtrain.scheduler import backbone
from tests.factories import TINY_GPT, make_campaign, make_text_dataset, make_user

from .test_campaign_form import valid_post

pytestmark = pytest.mark.django_db


def test_the_form_has_a_field_for_every_setting_with_its_label(organizer_client: Client) -> None:
    html = organizer_client.get("/campaigns/new").content.decode()

    for name, setting in SETTINGS.items():
        assert f'name="{name}"' in html and f"{setting.label}:</label>" in html, name


def test_an_organizer_sets_the_gradient_norm_bound(organizer_client: Client, text_dataset: Dataset) -> None:
    organizer_client.post("/campaigns/new", valid_post(text_dataset, max_grad_norm=50))

    assert Campaign.objects.get().max_grad_norm == 50


def test_a_started_campaign_keeps_its_gradient_norm_bound(organizer_client: Client, text_dataset: Dataset) -> None:
    organizer_client.post("/campaigns/new", valid_post(text_dataset, max_grad_norm=50))
    campaign = Campaign.objects.get()
    Campaign.objects.filter(pk=campaign.pk).update(state=Campaign.State.RUNNING)

    page = organizer_client.get(f"/campaigns/{campaign.pk}/edit").content.decode()
    organizer_client.post(f"/campaigns/{campaign.pk}/edit", valid_post(text_dataset, max_grad_norm=5, max_steps=40))

    campaign.refresh_from_db()
    assert "disabled" in page.split('name="max_grad_norm"')[1].split(">")[0]
    assert campaign.max_grad_norm == 50 and campaign.max_steps == 40


def test_the_lock_list_is_the_tables() -> None:
    locking = {name for name, setting in SETTINGS.items() if setting.locks}

    assert locking <= set(LOCKED_FIELDS) and {"max_grad_norm", "checkpoint_every", "seed"} <= locking
    assert not {"max_steps", "target_val_loss", "validate_every"} & set(LOCKED_FIELDS)


def test_the_detail_page_shows_every_setting(organizer_client: Client, olga: AbstractBaseUser) -> None:
    campaign = make_campaign(max_grad_norm=123.5, checkpoint_every=7, max_steps=50)
    Campaign.objects.filter(pk=campaign.pk).update(owner=olga)

    html = organizer_client.get(f"/campaigns/{campaign.pk}/").content.decode()

    for name, setting in SETTINGS.items():
        assert f"<dt>{setting.label}</dt>" in html and f'data-setting="{name}"' in html, name
    assert 'data-setting="max_grad_norm">123.5' in html and 'data-setting="checkpoint_every">7' in html


def test_every_slice_assignment_carries_the_settings_aggregators_need() -> None:
    campaign = make_campaign(max_grad_norm=42.0, checkpoint_every=3, seed=11, staleness=2)

    message = backbone._assign_message(campaign.slices.get(), campaign)

    assert (message.max_grad_norm, message.checkpoint_every, message.seed, message.staleness) == (42.0, 3, 11, 2)


def test_seed_run_accepts_exactly_the_tables_settings() -> None:
    assert CAMPAIGN_FIELDS == {"name", "architecture", "model_config", "optimizer", *SETTINGS}


def test_the_admin_edits_campaigns_through_the_checking_form() -> None:
    assert admin.site._registry[Campaign].form is CampaignAdminForm


# ---------------------------------------------------------------------- errors carry their field

BAD = [
    ({"architecture": "gpt", "model_config": {**TINY_GPT, "n_layer": 0}}, "gpt__n_layer"),
    ({"architecture": "gpt", "model_config": {**TINY_GPT, "n_head": 3}}, "gpt__n_embd"),
    ({"architecture": "gpt", "model_config": {**TINY_GPT, "block_size": 16}}, "gpt__block_size"),
    ({"architecture": "gpt", "model_config": {"layers": 2}}, "architecture"),
    ({"architecture": "alexnet", "model_config": {}}, "architecture"),
    ({"architecture": "mlp", "model_config": {}}, "dataset"),
    ({"codec": "int3"}, "codec"),
    ({"target_batch_size": 2, "microbatch_size": 4}, "microbatch_size"),
    ({"staleness": 9}, "staleness"),
    ({"max_grad_norm": -1.0}, "max_grad_norm"),
    ({"optimizer": {"name": "adam"}}, "optimizer"),
    ({"optimizer": {"eps": 0.0}}, "eps"),
]


@pytest.mark.parametrize(("fields", "field"), BAD, ids=[f for _, f in BAD])
def test_a_config_error_names_its_form_field(fields: dict[str, Any], field: str) -> None:
    options: dict[str, Any] = {"architecture": "gpt", "model_config": TINY_GPT, "target_batch_size": 32,
                               "microbatch_size": 4, **fields}  # fmt: skip

    with pytest.raises(CampaignConfigError) as caught:
        create_campaign(name="c", owner=make_user("u"), dataset=make_text_dataset(), **options)

    assert caught.value.field == field, str(caught.value)
