"""Write deploy/prometheus/alerts.yml from the site's alert declarations (``crowdtrain.ops.alert_rules``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from crowdtrain.ops.alert_rules import render


class Command(BaseCommand):
    help = "Write Prometheus's alerting rules from the thresholds the site's health checks use."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--out",
            type=Path,
            default=Path(settings.BASE_DIR) / "deploy" / "prometheus" / "alerts.yml",
            help="the rule file to write (default: deploy/prometheus/alerts.yml)",
        )
        parser.add_argument("--check", action="store_true", help="write nothing; fail if the file differs")

    def handle(self, *args: Any, **options: Any) -> None:
        out: Path = options["out"]
        text = render()
        if options["check"]:
            if not out.exists() or out.read_text() != text:
                raise CommandError(f"{out} is not what the declarations give; run manage.py write_alert_rules")
            return
        out.write_text(text)
        self.stdout.write(f"wrote {out}")
