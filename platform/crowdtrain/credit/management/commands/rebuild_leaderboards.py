from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from crowdtrain.credit import boards


class Command(BaseCommand):
    help = "Recompute every leaderboard from the credit ledger (after a Redis that lost its data, or to audit them)."

    def handle(self, *args: Any, **options: Any) -> None:
        boards.rebuild()
        self.stdout.write(self.style.SUCCESS("leaderboards rebuilt from the credit ledger"))
