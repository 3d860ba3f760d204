"""Print a campaign's committed steps, their sample ranges and its slices as JSON.

Tests and benchmarks read a child site's SQLite file through this command
instead of opening it in their own process (where pytest-django owns the
database settings)::

    ./manage.py dump_run --campaign 1
"""

from __future__ import annotations

import json
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db.models import Count, Sum

from crowdtrain.accounts.models import Device
from crowdtrain.campaigns.models import Campaign
from crowdtrain.datasets.models import Shard
from crowdtrain.scheduler.endings import step_ranges
from crowdtrain_agent.protocol.schema import to_dict


def _iso(value: Any) -> str | None:
    return value.isoformat() if value is not None else None


def dump_campaign(campaign: Campaign) -> dict[str, Any]:
    steps = []
    for step in campaign.steps.order_by("index"):
        steps.append(
            {
                "index": step.index,
                "num_samples": step.num_samples,
                "loss_sum": step.loss_sum,
                "committed_at": _iso(step.committed_at),
                "applied_at": _iso(step.applied_at),
                "ranges": step_ranges(step),
                "leases": [
                    {
                        "id": lease.pk,
                        "device": lease.device_id,
                        "base_version": lease.base_version,
                        "num_samples": lease.num_samples,
                        "ranges": lease.ranges,
                    }
                    for lease in step.leases.order_by("id")
                ],
            }
        )
    lease_states = dict(campaign.leases.values_list("state").annotate(n=Count("id")))
    return {
        "id": campaign.pk,
        "state": campaign.state,
        "architecture": campaign.architecture,
        "model_config": campaign.model_config,
        "optimizer": campaign.optimizer,
        "seed": campaign.seed,
        "target_batch_size": campaign.target_batch_size,
        "committed_steps": campaign.committed_steps,
        "version": campaign.version,
        "param_count": campaign.param_count,
        "dataset": {
            "kind": campaign.dataset.kind,
            "sample_len": campaign.dataset.sample_len,
            # How agents read the shards (``Dataset.data_spec``), with the campaign's augmentation.
            "spec": to_dict(campaign.dataset.data_spec(augment=campaign.augmentation)),
            # The training shards in the order leases walk them: where a gap in the committed samples lies.
            "shards": [
                {"sha256": sha, "num_samples": n}
                for sha, n in campaign.dataset.shards.filter(split=Shard.Split.TRAIN)
                .order_by("index")
                .values_list("sha256", "num_samples")
            ],
        },
        "media_root": str(settings.MEDIA_ROOT),
        "slices": [
            {
                "index": s.index,
                "start": s.start,
                "end": s.end,
                "version": s.version,
                "params_url": s.aggregator.params_url,
                "upload_url": s.aggregator.upload_url,
            }
            for s in campaign.slices.select_related("aggregator").order_by("index")
        ],
        "lease_states": lease_states,
        # What the agents' done reports say their links carried, over the committed steps (protocol 2.3).
        "network": campaign.step_network.aggregate(
            samples=Sum("samples"), bytes_up=Sum("bytes_up"), bytes_down=Sum("bytes_down")
        ),
        # Leases of steps a rollback undid: each stands for work lost to a failure.
        "rolled_back_leases": campaign.leases.filter(reason__startswith="rolled back").count(),
        "blocked_reason": campaign.blocked_reason,
        # What each leasing device said of itself in its hello (kind, name, memory, speed): which ran where.
        "hardware": {
            str(pk): hardware
            for pk, hardware in Device.objects.filter(pk__in=campaign.leases.values("device_id")).values_list(
                "pk", "hardware"
            )
        },
        "steps": steps,
        **_verification(campaign),
    }


def _verification(campaign: Campaign) -> dict[str, Any]:
    """Per volunteer (by username): credit, standing and the checks of their leases, for the trust tests."""
    from crowdtrain.credit.models import CreditEntry
    from crowdtrain.verification.models import Answer, Check, Standing

    credit = dict(
        CreditEntry.objects.filter(campaign=campaign)
        .values_list("volunteer__username")
        .annotate(n=Sum("samples"))
        .values_list("volunteer__username", "n")
    )
    standings = {
        s.volunteer.username: {
            "state": s.state,
            "passed": s.checks_passed,
            "failed": s.checks_failed,
            "refused": s.uploads_refused,
            "rulings_won": s.rulings_won,
            "rulings_lost": s.rulings_lost,
            "reason": s.reason,
            "changed_at": _iso(s.changed_at),
        }
        for s in Standing.objects.select_related("volunteer")
    }
    checks = [
        {
            "lease": c.lease_id,
            "volunteer": c.volunteer.username,
            "state": c.state,
            "detail": c.detail,
            "created_at": _iso(c.created_at),
        }
        for c in Check.objects.filter(campaign=campaign).select_related("volunteer").order_by("created_at")
    ]
    answers = list(
        Answer.objects.filter(case__campaign=campaign)
        .values_list("volunteer__username", "role", "verdict")
        .order_by("issued_at")
    )
    devices = dict(campaign.leases.order_by().values_list("device__owner__username", "device_id").distinct())
    return {
        "credit": credit,
        "standings": standings,
        "devices": devices,
        "checks": checks,
        "answers": [list(a) for a in answers],
    }


class Command(BaseCommand):
    help = "Print one campaign's steps, sample ranges, slices and lease counts as JSON."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--campaign", type=int, required=True, help="campaign id")

    def handle(self, *args: Any, **options: Any) -> None:
        campaign = Campaign.objects.select_related("dataset").filter(pk=options["campaign"]).first()
        if campaign is None:
            raise CommandError(f"no campaign {options['campaign']}; seed_run prints the ids it created")
        self.stdout.write(json.dumps(dump_campaign(campaign)))
