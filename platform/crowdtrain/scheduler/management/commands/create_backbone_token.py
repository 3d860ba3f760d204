"""Register an aggregator and print its token once."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from crowdtrain.accounts.tokens import hash_token, new_token
from crowdtrain.scheduler.models import Aggregator


class Command(BaseCommand):
    help = "Create (or re-key with --rotate) an aggregator and print its token for CROWDTRAIN_BACKBONE_TOKEN."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--name", required=True, help="aggregator name; the same name gets its slices back")
        parser.add_argument("--rotate", action="store_true", help="replace the token of an existing aggregator")

    def handle(self, *args: Any, **options: Any) -> None:
        token = new_token("ctb")
        existing = Aggregator.objects.filter(name=options["name"]).first()
        if existing and not options["rotate"]:
            raise CommandError(f"aggregator {options['name']!r} exists; pass --rotate to issue it a new token")
        if existing:
            existing.token_hash = hash_token(token)
            existing.save(update_fields=["token_hash"])
        else:
            Aggregator.objects.create(name=options["name"], token_hash=hash_token(token))
        self.stdout.write(token)
