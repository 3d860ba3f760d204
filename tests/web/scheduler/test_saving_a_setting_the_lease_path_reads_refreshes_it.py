"""Saving a setting the lease path reads makes site processes re-read the campaign; saving another does not.

Before the settings table marked them, a hand-kept list missed ``check_fraction``, ``training_mode``,
``aggregation`` and ``trim_fraction``: an organizer's new check fraction went unheeded until something else
moved the campaign's generation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from crowdtrain.campaigns.settings_table import SETTINGS, lease_settings
from crowdtrain.scheduler import configs
from tests.factories import make_campaign

pytestmark = pytest.mark.django_db


def test_the_table_marks_the_settings_the_hand_kept_list_missed() -> None:
    marked = lease_settings()

    assert {"check_fraction", "training_mode", "aggregation", "trim_fraction"} <= marked
    assert {"seed", "validate_every", "target_val_loss"}.isdisjoint(marked)
    assert marked <= set(SETTINGS)


def test_a_new_check_fraction_reaches_the_lease_path(django_capture_on_commit_callbacks: Callable[..., Any]) -> None:
    campaign = make_campaign(check_fraction=0.05)
    assert configs.campaign_config(campaign.pk).check_fraction == 0.05  # type: ignore[union-attr]

    campaign.check_fraction = 0.5
    with django_capture_on_commit_callbacks(execute=True):
        campaign.save(update_fields=["check_fraction"])

    assert configs.campaign_config(campaign.pk).check_fraction == 0.5  # type: ignore[union-attr]


@pytest.mark.parametrize("name", ["aggregation", "trim_fraction", "training_mode"])
def test_saving_a_setting_the_lease_path_reads_drops_the_cached_copy(
    name: str, django_capture_on_commit_callbacks: Callable[..., Any]
) -> None:
    campaign = make_campaign()
    cached = configs.campaign_config(campaign.pk)

    with django_capture_on_commit_callbacks(execute=True):
        campaign.save(update_fields=[name])

    assert configs.campaign_config(campaign.pk) is not cached


def test_saving_a_setting_it_never_reads_keeps_the_cached_copy(
    django_capture_on_commit_callbacks: Callable[..., Any],
) -> None:
    campaign = make_campaign()
    cached = configs.campaign_config(campaign.pk)

    campaign.validate_every = 7
    with django_capture_on_commit_callbacks(execute=True):
        campaign.save(update_fields=["validate_every"])

    assert configs.campaign_config(campaign.pk) is cached
