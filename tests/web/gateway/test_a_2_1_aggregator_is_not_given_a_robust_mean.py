"""A 2.1 aggregator would take the plain mean: a campaign with a robust mean is never sent to it stripped.

It may get a plain-mean campaign without the clip factor (it only loses a
defence) and without the trim fraction (meaningless with the plain mean).
"""

from __future__ import annotations

import json

import pytest

from crowdtrain.gateway.outbox import send_event
from crowdtrain.scheduler import backbone
from tests.factories import make_campaign

pytestmark = pytest.mark.django_db


def test_a_robust_mean_cannot_be_sent_to_a_2_1_aggregator() -> None:
    campaign = make_campaign(aggregation="trimmed_mean", trim_fraction=0.2)

    event = send_event(backbone._assign_message(campaign.slices.get(), campaign))

    assert event.get("unsendable", {}).get("1") == "aggregation"  # (2.0 also lacks ticket_key)
    assert json.loads(event["text"])["aggregation"] == "trimmed_mean"


def test_a_plain_mean_reaches_a_2_1_aggregator_without_the_new_fields() -> None:
    campaign = make_campaign(clip_factor=3.0, trim_fraction=0.3)

    event = send_event(backbone._assign_message(campaign.slices.get(), campaign))

    for_2_1 = json.loads(event["older"]["1"])
    assert "1" not in event.get("unsendable", {})
    assert not {"aggregation", "clip_factor", "trim_fraction"} & set(for_2_1)
    assert json.loads(event["text"])["clip_factor"] == 3.0
