"""A browser tab gets leases only of campaigns whose graphs passed, in sync mode; other devices are unaffected."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from crowdtrain.accounts.models import Device
from crowdtrain.browser import checking
from crowdtrain.browser.models import BrowserGraph
from crowdtrain.campaigns.models import Campaign
from crowdtrain.scheduler import browser_tabs, leasing
from crowdtrain_agent.protocol import Lease, NoLease
from tests.factories import make_campaign, make_device

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def graphs_on() -> Iterator[None]:
    with override_settings(CROWDTRAIN_BROWSER_GRAPHS=True):
        yield


def verdict(campaign: Campaign, status: str, reason: str = "") -> None:
    row = checking.request_check(campaign.architecture, campaign.model_config, campaign.microbatch_size, queue=False)
    assert row is not None
    BrowserGraph.objects.filter(pk=row.pk).update(status=status, reason=reason)
    browser_tabs.clear_caches()


def tab() -> Device:
    device, _ = make_device("vera", "firefox tab")
    browser_tabs.note_kind(device.pk, "browser")
    return device


def test_a_tab_waits_while_the_campaigns_model_is_checked() -> None:
    campaign = make_campaign()
    verdict(campaign, "pending")

    answer = leasing.request_lease(tab().pk, campaign.pk, 10.0)

    assert isinstance(answer, NoLease) and answer.reason == "campaign_paused" and answer.retry_after_s == 30.0
    assert answer.detail == f"browser compute is not offered for campaign {campaign.pk} yet: its model is being checked"


@pytest.mark.parametrize(("started_s_ago", "queued"), [(None, True), (10_000.0, True), (5.0, False)])
def test_a_tab_asking_queues_a_check_nobody_is_running(
    started_s_ago: float | None, queued: bool, monkeypatch: pytest.MonkeyPatch, django_capture_on_commit_callbacks: Any
) -> None:
    """A check queued by a process that exited first, or whose worker died, is queued again when a tab asks."""
    campaign = make_campaign()
    verdict(campaign, "pending")
    started = None if started_s_ago is None else timezone.now() - timedelta(seconds=started_s_ago)
    BrowserGraph.objects.update(started_at=started)
    dispatched: list[int] = []
    monkeypatch.setattr(checking, "dispatch", dispatched.append)

    with django_capture_on_commit_callbacks(execute=True):
        answer = leasing.request_lease(tab().pk, campaign.pk, 10.0)

    assert isinstance(answer, NoLease) and answer.reason == "campaign_paused"
    assert dispatched == ([BrowserGraph.objects.get().pk] if queued else [])


def test_a_tab_is_told_why_a_refused_campaign_is_not_for_it() -> None:
    campaign = make_campaign()
    verdict(campaign, "refused", "gpt: gradients differ from PyTorch's")

    answer = leasing.request_lease(tab().pk, campaign.pk, 10.0)

    assert isinstance(answer, NoLease) and answer.reason == "campaign_paused"
    assert (
        answer.detail
        == f"browser compute is not offered for campaign {campaign.pk}: gpt: gradients differ from PyTorch's"
    )


def test_a_tab_leases_a_campaign_whose_graph_passed() -> None:
    campaign = make_campaign()
    verdict(campaign, "passed")

    answer = leasing.request_lease(tab().pk, campaign.pk, 10.0)

    assert isinstance(answer, Lease) and answer.campaign_id == campaign.pk


def test_a_tab_gets_no_lease_of_a_campaign_in_local_mode() -> None:
    campaign = make_campaign(training_mode="local", check_fraction=0.0)
    verdict(campaign, "passed")  # a graph of the same model passed for another campaign

    answer = leasing.request_lease(tab().pk, campaign.pk, 10.0)

    assert isinstance(answer, NoLease) and answer.reason == "campaign_paused"
    assert "trains in local mode (DiLoCo)" in answer.detail


def test_a_tab_asking_for_any_campaign_skips_those_not_for_it() -> None:
    refused = make_campaign()
    verdict(refused, "refused", "gpt: refused")
    offered = make_campaign(microbatch_size=2)
    verdict(offered, "passed")

    answer = leasing.request_lease(tab().pk, None, 10.0)

    assert isinstance(answer, Lease) and answer.campaign_id == offered.pk


def test_an_agent_is_unaffected_by_a_refused_or_unchecked_graph() -> None:
    refused, unchecked = make_campaign(), make_campaign(microbatch_size=2)
    verdict(refused, "refused", "gpt: refused")
    agent, _ = make_device("walt", "workstation")
    browser_tabs.note_kind(agent.pk, "cuda")
    other, _ = make_device("xena", "laptop")  # no hello in this process; its stored hardware says cpu
    Device.objects.filter(pk=other.pk).update(hardware={"kind": "cpu"})

    answers = [leasing.request_lease(agent.pk, refused.pk, 10.0), leasing.request_lease(other.pk, unchecked.pk, 10.0)]

    assert all(isinstance(answer, Lease) for answer in answers)


def test_a_tab_whose_hello_another_process_handled_is_known_by_its_stored_hardware() -> None:
    campaign = make_campaign()
    device, _ = make_device("vera", "tab")
    Device.objects.filter(pk=device.pk).update(hardware={"kind": "browser", "name": "Chromium"})

    answer = leasing.request_lease(device.pk, campaign.pk, 10.0)

    assert isinstance(answer, NoLease) and "not offered" in answer.detail


def test_the_verdict_is_read_once_per_few_seconds_not_per_request() -> None:
    campaign = make_campaign()
    verdict(campaign, "pending")
    device = tab()
    leasing.request_lease(device.pk, campaign.pk, 10.0)

    with CaptureQueriesContext(connection) as queries:
        answer = leasing.request_lease(device.pk, campaign.pk, 10.0)

    assert isinstance(answer, NoLease)
    assert not [q for q in queries.captured_queries if "browser_browsergraph" in q["sql"] or "hardware" in q["sql"]]
