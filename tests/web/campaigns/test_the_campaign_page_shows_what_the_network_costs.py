"""The campaign page shows what the network costs: bytes per sample each way and the network's share of the
swarm's time, from the agents' done reports, bounded against lying agents, and unknown for older agents."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from django.core.cache import cache
from django.test import Client

from crowdtrain.accounts.models import Device
from crowdtrain.campaigns.models import Campaign
from crowdtrain.ops import campaign_monitor as monitor
from crowdtrain.scheduler import leasing, network, reporting
from crowdtrain.scheduler.configs import campaign_config
from crowdtrain.scheduler.models import StepNetwork
from tests.conftest import FakeClock
from tests.factories import done_for, logged_in, make_campaign, make_device, make_organizer

pytestmark = pytest.mark.django_db

SAMPLES = 4  # per lease, and per step: each report below commits a step


@pytest.fixture(autouse=True)
def _no_cached_figures() -> None:
    cache.clear()


def owned(**fields: Any) -> tuple[Campaign, Client]:
    campaign = make_campaign(target_batch_size=SAMPLES, microbatch_size=SAMPLES, **fields)
    olga = make_organizer("olga")
    Campaign.objects.filter(pk=campaign.pk).update(owner=olga)
    client = logged_in(olga)
    return Campaign.objects.get(pk=campaign.pk), client


def report(device: Device, clock: FakeClock, **cost: Any) -> None:
    """One lease of SAMPLES samples, held 5 s and computed in 0.3 s, reported with ``cost``; its step commits."""
    lease = leasing.request_lease(device.pk, None, 1000.0)
    clock.advance(5.0)
    done = msgspec.structs.replace(done_for(lease.lease_id), compute_s=0.3, **cost)
    outcome = reporting.report_done(device.pk, done)
    assert outcome.ack.accepted and len(outcome.commits) == 1


def feed(client: Client, campaign: Campaign) -> dict[str, Any]:
    response = client.get(f"/api/campaigns/{campaign.pk}/monitor")
    assert response.status_code == 200, response.content
    return response.json()["network"]


def test_reports_add_up_per_step_and_the_page_shows_bytes_per_sample_and_the_network_share(
    clock: FakeClock,
) -> None:
    campaign, client = owned(codec="fp16")
    vera, _ = make_device("vera")
    up = 2 * campaign.param_count + 2_000  # fp16: two bytes per parameter, and chunk headers

    report(vera, clock, bytes_up=up, bytes_down=40_000, network_s=0.1)
    report(vera, clock, bytes_up=up, bytes_down=0, network_s=0.1)

    rows = list(StepNetwork.objects.filter(campaign=campaign).order_by("step__index"))
    assert [(r.samples, r.unreported_samples, r.bytes_up, r.bytes_down) for r in rows] == [
        (SAMPLES, 0, up, 40_000),
        (SAMPLES, 0, up, 0),
    ]
    assert rows[0].network_s == pytest.approx(0.1) and rows[0].compute_s == pytest.approx(0.3)
    campaign.refresh_from_db()
    shown = feed(client, campaign)
    assert shown["codec"] == "fp16" and shown["training_mode"] == "sync"
    run = shown["run"]
    assert run["bytes_up_per_sample"] == pytest.approx(up / SAMPLES)
    assert run["bytes_down_per_sample"] == pytest.approx(40_000 / (2 * SAMPLES))
    assert run["network_share"] == pytest.approx(0.1 / (0.1 + 0.3))
    assert run["share_text"] == "25%" and run["unreported_text"] == ""
    assert shown["recent"] == run  # two steps: both in the recent window
    assert run["per_sample_text"] == f"{monitor.byte_size(up / SAMPLES)} up, 5.0 kB down per sample"
    html = client.get(f"/campaigns/{campaign.pk}/").content.decode()
    assert run["per_sample_text"] in html and "fp16" in html


def test_a_campaign_without_reports_says_so() -> None:
    campaign, client = owned()

    shown = feed(client, campaign)

    assert shown["run"]["per_sample_text"] == "no reports yet" and shown["run"]["share_text"] == "–"
    assert "no reports yet" in client.get(f"/campaigns/{campaign.pk}/").content.decode()


def test_a_lying_agents_bytes_are_held_to_what_the_campaign_makes_possible(clock: FakeClock) -> None:
    campaign, client = owned()  # fp32
    liar, _ = make_device("mallory")
    fewest, most = network.upload_bounds(campaign_config(campaign.pk))  # type: ignore[arg-type]

    report(liar, clock, bytes_up=2**62, bytes_down=2**62, network_s=1e9)
    report(liar, clock, bytes_up=1, bytes_down=0, network_s=0.0)

    assert fewest == 4 * campaign.param_count and most < 3 * fewest
    rows = list(StepNetwork.objects.filter(campaign=campaign).order_by("step__index"))
    assert rows[0].bytes_up == most  # clamped to two full sends of the fp32 gradient, plus headers
    assert rows[0].bytes_down == network.download_bound(campaign_config(campaign.pk))  # type: ignore[arg-type]
    # no more than the lease was held (5 s on the fake clock; Redis adds the microseconds its script runs)
    assert rows[0].network_s == pytest.approx(5.0, abs=0.05)
    assert rows[1].bytes_up == fewest  # no upload is smaller than its gradient
    campaign.refresh_from_db()
    assert feed(client, campaign)["run"]["bytes_up_per_sample"] <= most / SAMPLES


def test_an_older_agents_leases_are_unknown_not_free(clock: FakeClock) -> None:
    campaign, client = owned()
    old, _ = make_device("olaf")  # protocol 2.2: its report has no traffic, which decodes as 0
    new, _ = make_device("nina")

    report(old, clock)
    campaign.refresh_from_db()
    alone = feed(client, campaign)["run"]
    report(new, clock, bytes_up=4 * campaign.param_count, bytes_down=1_000, network_s=0.3)
    campaign.refresh_from_db()
    mixed = feed(client, campaign)["run"]

    assert alone["bytes_up_per_sample"] is None and alone["network_share"] is None
    assert alone["per_sample_text"] == "unknown: the agents are too old to report it"
    # The old agent's samples are left out of the figures, not averaged in as costing nothing.
    assert mixed["samples"] == SAMPLES and mixed["unreported_samples"] == SAMPLES
    assert mixed["bytes_up_per_sample"] == pytest.approx(campaign.param_count)
    assert mixed["network_share"] == pytest.approx(0.5)
    assert mixed["unreported_text"].startswith("50% of the samples came from agents too old")


def test_volunteers_see_the_cost_on_the_join_page(clock: FakeClock) -> None:
    campaign, _ = owned(codec="int8")
    vera = make_device("vera")
    volunteer = logged_in(vera[0].owner)

    before = volunteer.get(f"/campaigns/{campaign.pk}/join").content.decode()
    report(vera[0], clock, bytes_up=campaign.param_count + 500, bytes_down=8_000, network_s=0.1)
    cache.clear()
    after = volunteer.get(f"/campaigns/{campaign.pk}/join").content.decode()

    assert 'data-testid="network-cost"' not in before
    assert "2.0 kB down per sample" in after and "int8 gradients" in after and "25%" in after


@pytest.mark.parametrize(
    ("count", "text"),
    [(0, "0 B"), (999, "999 B"), (1_000, "1.0 kB"), (41_234, "41 kB"), (9_960, "10 kB"), (1.2e9, "1.2 GB")],
)
def test_byte_counts_read_in_decimal_units(count: float, text: str) -> None:
    assert monitor.byte_size(count) == text
