"""Export and gate campaigns' models for browser tabs now, in this process, one line per campaign.

./manage.py check_browser_graphs                 # every running or paused campaign not yet checked
./manage.py check_browser_graphs --campaign 3    # one campaign, whatever its state
./manage.py check_browser_graphs --again         # check once more those already decided (a newer exporter)
"""

from __future__ import annotations

import time
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from crowdtrain.browser.checking import request_check, run_check
from crowdtrain.browser.models import BrowserGraph
from crowdtrain.campaigns.browser_checks import LOCAL_MODE_REASON, browser_verdict
from crowdtrain.campaigns.models import Campaign


class Command(BaseCommand):
    help = "Export each campaign's gradient graphs for browser tabs and gate them against PyTorch, now."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--campaign", type=int, help="only this campaign (any state)")
        parser.add_argument("--again", action="store_true", help="check models already decided once more")
        parser.add_argument(
            "--graph",
            type=int,
            help="check one stored model by its row id (what a campaign's start runs without a worker)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if not settings.CROWDTRAIN_BROWSER_GRAPHS:
            raise CommandError("browser compute is off: set CROWDTRAIN_BROWSER_GRAPHS=true to check graphs")
        if options["graph"] is not None:
            self._check_row(options["graph"])
            return
        campaigns = Campaign.objects.order_by("pk")
        if options["campaign"] is not None:
            campaigns = campaigns.filter(pk=options["campaign"])
            if not campaigns.exists():
                raise CommandError(f"no campaign {options['campaign']}; see the campaign list for ids")
        else:
            campaigns = campaigns.filter(state__in=[Campaign.State.RUNNING, Campaign.State.PAUSED])
        for campaign in campaigns:
            self._check(campaign, again=options["again"])

    def _check(self, campaign: Campaign, *, again: bool) -> None:
        label = f"campaign {campaign.pk} ({campaign.architecture}, microbatch {campaign.microbatch_size})"
        if campaign.training_mode == Campaign.TrainingMode.LOCAL:
            self.stdout.write(f"{label}: not offered: {LOCAL_MODE_REASON}")
            return
        graph = request_check(
            campaign.architecture, campaign.model_config, campaign.microbatch_size, again=again, queue=False
        )
        if graph is None:  # unreachable: checked in handle
            return
        self.stdout.write(f"{label}: checking...")
        began = time.monotonic()
        checked = run_check(graph.pk)
        verdict = browser_verdict(campaign)
        if checked is None and verdict.status == "pending":
            self.stdout.write(f"{label}: another worker is checking it; see the campaign's page for its verdict")
            return
        taken = f" in {time.monotonic() - began:.1f} s" if checked is not None else " (checked before; --again)"
        wide = verdict.graph.wide_size if verdict.graph is not None else 0
        runs = f"; tabs run {wide} samples a run where a lease has them (the wide graph)" if wide else ""
        self.stdout.write(f"{label}: {verdict.status}{taken}: {verdict.reason}{runs}")

    def _check_row(self, graph_id: int) -> None:
        label = f"browser graph {graph_id}"
        if not BrowserGraph.objects.filter(pk=graph_id).exists():
            raise CommandError(f"no browser graph {graph_id}; `check_browser_graphs --campaign N` checks a campaign's")
        began = time.monotonic()
        checked = run_check(graph_id)
        if checked is None:
            self.stdout.write(f"{label}: already decided, or another worker is checking it")
            return
        self.stdout.write(f"{label}: {checked.status} in {time.monotonic() - began:.1f} s: {checked.reason}")
