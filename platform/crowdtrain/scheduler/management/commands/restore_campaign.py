"""Unblock a campaign whose slice lost its state: go back to a complete checkpoint, or start over.

manage.py restore_campaign 7                    # show its state and the complete versions
manage.py restore_campaign 7 --to 40              # every slice back to version 40
manage.py restore_campaign 7 --from-scratch     # back to the initial weights (version 0)
"""

from __future__ import annotations

from typing import Any

from asgiref.sync import async_to_sync
from django.core.management.base import BaseCommand, CommandError, CommandParser

from crowdtrain.campaigns.models import Campaign
from crowdtrain.gateway.outbox import send_outbox
from crowdtrain.scheduler.backbone import restore_campaign
from crowdtrain.scheduler.durability import complete_versions


class Command(BaseCommand):
    help = "Restore a campaign to a complete checkpoint (--to N) or to its initial weights (--from-scratch)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("campaign", type=int, help="campaign id")
        choice = parser.add_mutually_exclusive_group()
        choice.add_argument(
            "--to", type=int, metavar="VERSION", help="a complete version (listed when run without options)"
        )
        choice.add_argument("--from-scratch", action="store_true", help="forget every step; restart at version 0")

    def handle(self, *args: Any, **options: Any) -> None:
        campaign = Campaign.objects.filter(pk=options["campaign"]).first()
        if campaign is None:
            raise CommandError(f"no campaign {options['campaign']}")
        complete = complete_versions(campaign)
        version = 0 if options["from_scratch"] else options["to"]
        if version is None:
            self.stdout.write(
                f"campaign {campaign.pk} ({campaign.name}): {campaign.committed_steps} steps committed; "
                f"{campaign.blocked_reason or 'not blocked'}\n"
                f"complete checkpoints: {', '.join(map(str, complete)) or 'none'}\n"
                "choose --to VERSION (one of those) or --from-scratch"
            )
            return
        try:
            outbox = restore_campaign(campaign.pk, version)
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        async_to_sync(send_outbox)(outbox)
        self.stdout.write(f"campaign {campaign.pk} restored to version {version}; its aggregators were told")
