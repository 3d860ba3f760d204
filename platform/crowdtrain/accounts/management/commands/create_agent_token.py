"""Create an agent device token for a volunteer (the browser login flow comes later)."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandParser

from crowdtrain.accounts.models import Device


class Command(BaseCommand):
    help = "Create a device and print its API token once (e.g. export CROWDTRAIN_AGENT_TOKEN=...)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--user", required=True, help="volunteer username; created if missing")
        parser.add_argument("--device", default="agent", help="device name shown to the volunteer")

    def handle(self, *args: Any, **options: Any) -> None:
        user, _ = get_user_model().objects.get_or_create(username=options["user"])
        _, token = Device.issue(user, options["device"])
        self.stdout.write(token)
