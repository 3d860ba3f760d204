"""Starting a campaign queues the check of its model for browsers after the commit, and never waits for it."""

from __future__ import annotations

import io
import logging
import math
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.test import Client, override_settings

from crowdtrain.browser import checking, gate
from crowdtrain.browser.gate import GateResult
from crowdtrain.browser.models import BrowserGraph
from crowdtrain.campaigns import browser_checks
from crowdtrain.campaigns.models import Campaign
from tests.factories import logged_in, make_campaign, make_organizer

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def graphs_on() -> Iterator[None]:
    with override_settings(CROWDTRAIN_BROWSER_GRAPHS=True):
        yield


def refusing(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """No export: every model is refused at once, and the calls are counted."""
    calls: list[tuple[str, int]] = []

    def check(model_name: str, model_config: Any, size: int) -> Any:
        calls.append((model_name, size))
        return None, GateResult(model_name, False, f"{model_name}: refused in the test", None, None, math.inf)

    monkeypatch.setattr(gate, "check_browser_compute", check)
    return calls


def draft_of(**fields: Any) -> tuple[Campaign, Client]:
    owner = make_organizer("olga")
    campaign = make_campaign(**fields)
    Campaign.objects.filter(pk=campaign.pk).update(state=Campaign.State.DRAFT, owner=owner)
    client = logged_in(owner)
    return campaign, client


def start(client: Client, campaign: Campaign, capture: Callable[..., Any]) -> Any:
    with capture(execute=True):
        response = client.post(f"/campaigns/{campaign.pk}/lifecycle", {"action": "start"})
    assert response.status_code == 302
    return response


def test_a_start_checks_the_model_after_the_commit(
    monkeypatch: pytest.MonkeyPatch, django_capture_on_commit_callbacks: Any
) -> None:
    calls = refusing(monkeypatch)
    campaign, client = draft_of()

    start(client, campaign, django_capture_on_commit_callbacks)

    row = BrowserGraph.objects.get()
    assert (row.model_name, row.microbatch_size, row.status) == ("gpt", 4, "refused")
    assert row.reason == "gpt: refused in the test" and calls == [("gpt", 4)]
    page = client.get(f"/campaigns/{campaign.pk}/").content.decode()
    assert "not offered: gpt: refused in the test" in page


def test_with_eager_celery_the_start_returns_while_the_check_runs_in_a_process_of_its_own(
    monkeypatch: pytest.MonkeyPatch, django_capture_on_commit_callbacks: Any
) -> None:
    """Not a thread: torch.fx's tracing state is the process's, and a request building a model meanwhile broke."""
    started: list[list[str]] = []

    class Recorded:
        def __init__(self, argv: list[str], **options: Any) -> None:
            started.append(argv)
            assert options == {"stdin": subprocess.DEVNULL}

    monkeypatch.setattr(checking.subprocess, "Popen", Recorded)
    campaign, client = draft_of()

    with override_settings(CELERY_TASK_ALWAYS_EAGER=True, CROWDTRAIN_EAGER_TASKS_IN_BACKGROUND=True):
        start(client, campaign, django_capture_on_commit_callbacks)

    row = BrowserGraph.objects.get()
    [argv] = started
    assert argv[0] == sys.executable and argv[1].endswith("manage.py")
    assert argv[2:] == ["check_browser_graphs", "--graph", str(row.pk)]
    assert row.status == BrowserGraph.Status.PENDING  # the process decides it, not the request


def test_the_command_checks_one_row_by_id_as_the_process_of_a_start_does(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = refusing(monkeypatch)
    campaign = make_campaign()
    row = checking.request_check(campaign.architecture, campaign.model_config, campaign.microbatch_size, queue=False)
    assert row is not None
    out = io.StringIO()

    call_command("check_browser_graphs", "--graph", str(row.pk), stdout=out)
    call_command("check_browser_graphs", "--graph", str(row.pk), stdout=out)

    row.refresh_from_db()
    assert row.status == BrowserGraph.Status.REFUSED and len(calls) == 1
    lines = out.getvalue().splitlines()
    assert lines[0].startswith(f"browser graph {row.pk}: refused in ") and lines[0].endswith("refused in the test")
    assert lines[1] == f"browser graph {row.pk}: already decided, or another worker is checking it"
    with pytest.raises(CommandError, match="no browser graph 999999"):
        call_command("check_browser_graphs", "--graph", "999999")


def test_a_campaign_in_local_mode_is_not_checked_and_says_why(
    monkeypatch: pytest.MonkeyPatch, django_capture_on_commit_callbacks: Any
) -> None:
    calls = refusing(monkeypatch)
    campaign, client = draft_of(training_mode="local", check_fraction=0.0)

    start(client, campaign, django_capture_on_commit_callbacks)

    assert calls == [] and not BrowserGraph.objects.exists()
    page = client.get(f"/campaigns/{campaign.pk}/").content.decode()
    assert "not offered: it trains in local mode (DiLoCo)" in page


def test_a_failure_to_queue_the_check_does_not_stop_the_start(
    monkeypatch: pytest.MonkeyPatch, django_capture_on_commit_callbacks: Any, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the database hiccupped")

    monkeypatch.setattr(browser_checks, "request_check", broken)
    campaign, client = draft_of()

    with caplog.at_level(logging.ERROR, logger="crowdtrain.campaigns.browser_checks"):
        start(client, campaign, django_capture_on_commit_callbacks)

    campaign.refresh_from_db()
    assert campaign.state == Campaign.State.RUNNING
    assert any("could not be queued" in r.getMessage() and r.exc_info for r in caplog.records)


def test_a_pending_check_shows_on_the_organizers_page() -> None:
    campaign, client = draft_of()
    checking.request_check("gpt", campaign.model_config, 4, queue=False)

    page = client.get(f"/campaigns/{campaign.pk}/").content.decode()

    assert "checking whether browsers can compute this model..." in page


def test_a_passed_check_shows_the_gates_figures_on_the_organizers_page() -> None:
    campaign, client = draft_of()
    row = checking.request_check("gpt", campaign.model_config, 4, queue=False)
    assert row is not None
    BrowserGraph.objects.filter(pk=row.pk).update(
        status="passed", ratio=0.987, graph_error=2.0e-7, torch_error=2.1e-7, memory_bytes=3 << 20
    )

    page = client.get(f"/campaigns/{campaign.pk}/").content.decode()

    assert "offered (gate ratio 0.99: gradients 2.0e-07 from fp64, PyTorch fp32 2.1e-07; a tab needs about 3.0" in page


def test_the_command_checks_each_running_campaign_with_a_line_each(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    calls = refusing(monkeypatch)
    running = make_campaign()
    draft = make_campaign(microbatch_size=2)
    Campaign.objects.filter(pk=draft.pk).update(state=Campaign.State.DRAFT)
    out = io.StringIO()

    call_command("check_browser_graphs", stdout=out)
    call_command("check_browser_graphs", stdout=out)  # decided already: no second export
    call_command("check_browser_graphs", "--campaign", str(draft.pk), stdout=out)

    lines = out.getvalue().splitlines()
    label = f"campaign {running.pk} (gpt, microbatch 4)"
    assert lines[0] == f"{label}: checking..."
    assert lines[1].startswith(f"{label}: refused in ") and lines[1].endswith(" s: gpt: refused in the test")
    assert lines[3] == f"{label}: refused (checked before; --again): gpt: refused in the test"
    assert lines[5].startswith(f"campaign {draft.pk} (gpt, microbatch 2): refused in ")
    assert calls == [("gpt", 4), ("gpt", 2)]


def test_the_organizers_page_queues_again_a_check_whose_worker_died(
    monkeypatch: pytest.MonkeyPatch, django_capture_on_commit_callbacks: Any
) -> None:
    from datetime import timedelta

    from django.utils import timezone

    queued: list[int] = []
    monkeypatch.setattr(checking, "dispatch", queued.append)
    campaign, client = draft_of()
    Campaign.objects.filter(pk=campaign.pk).update(state=Campaign.State.RUNNING)
    row = checking.request_check("gpt", campaign.model_config, 4, queue=False)
    assert row is not None
    BrowserGraph.objects.filter(pk=row.pk).update(started_at=timezone.now())

    with override_settings(CROWDTRAIN_BROWSER_GRAPH_TIMEOUT_S=60), django_capture_on_commit_callbacks(execute=True):
        client.get(f"/campaigns/{campaign.pk}/")  # a live worker has it: nothing queued
        BrowserGraph.objects.filter(pk=row.pk).update(started_at=timezone.now() - timedelta(seconds=61))
        client.get(f"/campaigns/{campaign.pk}/")

    assert queued == [row.pk]
