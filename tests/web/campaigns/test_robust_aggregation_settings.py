"""An organizer chooses how aggregators combine a step (mean, trimmed mean, centered clipping) and how they clip."""

from __future__ import annotations

import pytest
from django.test import Client

from crowdtrain.campaigns.models import Campaign
from crowdtrain.datasets.models import Dataset
from crowdtrain.scheduler import backbone
from tests.factories import make_campaign

from .test_campaign_form import valid_post

pytestmark = pytest.mark.django_db


def test_a_new_campaign_takes_the_plain_mean_with_generous_clipping(
    organizer_client: Client, text_dataset: Dataset
) -> None:
    organizer_client.post("/campaigns/new", valid_post(text_dataset))

    campaign = Campaign.objects.get()
    assert (campaign.aggregation, campaign.clip_factor, campaign.trim_fraction) == ("mean", 10.0, 0.1)
    assert campaign.check_fraction == 0.05


def test_an_organizer_chooses_a_trimmed_mean(organizer_client: Client, text_dataset: Dataset) -> None:
    organizer_client.post(
        "/campaigns/new",
        valid_post(text_dataset, aggregation="trimmed_mean", trim_fraction=0.2, clip_factor=0, check_fraction=0.5),
    )

    campaign = Campaign.objects.get()
    assert (campaign.aggregation, campaign.trim_fraction, campaign.clip_factor) == ("trimmed_mean", 0.2, 0.0)
    assert campaign.check_fraction == 0.5


def test_a_trim_fraction_of_a_half_or_more_is_refused_by_name(organizer_client: Client, text_dataset: Dataset) -> None:
    response = organizer_client.post("/campaigns/new", valid_post(text_dataset, trim_fraction=0.6))

    errors = response.context["form"].errors
    assert list(errors) == ["trim_fraction"]
    assert "Trim fraction (trim_fraction) must be at least 0 and below 0.5, got 0.6" in errors["trim_fraction"][0]
    assert Campaign.objects.count() == 0


def test_every_slice_assignment_carries_the_campaigns_aggregation() -> None:
    campaign = make_campaign(aggregation="centered_clip", clip_factor=4.0, trim_fraction=0.25)

    message = backbone._assign_message(campaign.slices.get(), campaign)

    assert (message.aggregation, message.clip_factor, message.trim_fraction) == ("centered_clip", 4.0, 0.25)


def test_a_started_campaign_keeps_its_aggregation_but_may_check_more(
    organizer_client: Client, text_dataset: Dataset
) -> None:
    organizer_client.post("/campaigns/new", valid_post(text_dataset, aggregation="trimmed_mean"))
    campaign = Campaign.objects.get()
    Campaign.objects.filter(pk=campaign.pk).update(state=Campaign.State.RUNNING)

    organizer_client.post(
        f"/campaigns/{campaign.pk}/edit",
        valid_post(text_dataset, aggregation="mean", clip_factor=2, check_fraction=0.3),
    )

    campaign.refresh_from_db()
    assert (campaign.aggregation, campaign.clip_factor) == ("trimmed_mean", 10.0)
    assert campaign.check_fraction == 0.3
