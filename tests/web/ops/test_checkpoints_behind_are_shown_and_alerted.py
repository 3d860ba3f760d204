"""A campaign whose checkpoints lag shows it everywhere an operator looks: /healthz, /metrics, its page."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from crowdtrain.ops import campaign_monitor as monitor
from crowdtrain.scheduler import backbone
from crowdtrain_agent.protocol import CheckpointSaved
from tests.factories import commit_steps, make_campaign, make_device

from .scrape import scrape, value

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def bound(settings: Any) -> None:
    settings.CROWDTRAIN_CHECKPOINT_LAG_MAX = 3


def test_a_missed_interval_warns_and_the_bound_is_critical_until_a_checkpoint_completes() -> None:
    campaign = make_campaign(target_batch_size=4, microbatch_size=4, checkpoint_every=2, staleness=0)
    device, _ = make_device()

    commit_steps(campaign, device, 5)  # past one interval plus the pipeline's lag (2 + 0 + 2)
    warned = Client().get("/healthz").json()
    commit_steps(campaign, device, 1)  # 6: the bound
    held = Client().get("/healthz")
    page = monitor.snapshot(campaign)
    metrics = scrape(Client())
    s = campaign.slices.get()
    backbone.checkpoint_saved(s.aggregator_id, CheckpointSaved(campaign_id=campaign.pk, slice_index=0, version=6))
    cleared = Client().get("/healthz").json()

    assert [(a["code"], a["severity"]) for a in warned["alerts"]] == [("campaign_checkpoints_behind", "warning")]
    assert warned["status"] == "warning"
    assert held.status_code == 200 and held.json()["status"] == "degraded"
    assert "the newest complete checkpoint is version 0, 6 steps behind" in held.json()["alerts"][0]["message"]
    assert page["condition"]["code"] == "checkpoints_behind" and page["condition"]["level"] == "critical"
    assert page["progress"]["checkpoint_text"] == "version 0, 6 steps behind"
    assert value(metrics, "crowdtrain_campaign_checkpoint_lag_steps", campaign=str(campaign.pk)) == 6
    assert cleared["alerts"] == [] and cleared["status"] == "ok"
