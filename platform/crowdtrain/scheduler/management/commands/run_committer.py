"""Write full steps for the site processes (``crowdtrain.scheduler.committer``), until stopped."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from crowdtrain.scheduler.committer import Committer


class Command(BaseCommand):
    help = (
        "Write the steps the site processes fill, so a busy site does not write them itself; run one or more "
        "beside the sites. Stop with SIGTERM or Ctrl-C: the step being written is finished first."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--name", default=None, help="this committer's name in the logs (default: host:pid)")
        parser.add_argument(
            "--metrics-port",
            type=int,
            default=0,
            help="serve Prometheus metrics (step write times) on this port, to the token or private addresses as "
            "the site's /metrics; 0 for none (default)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if not settings.CROWDTRAIN_SCHEDULER_REDIS_URL:
            raise CommandError(
                "a committer shares the sites' scheduler state in Redis, and none is configured: set REDIS_URL "
                "(or CROWDTRAIN_SCHEDULER_REDIS_URL) as the site processes have it. Without Redis (the embedded "
                "default) the site writes its steps itself and needs no committer."
            )
        if options["metrics_port"]:
            from crowdtrain.ops.metrics_server import serve_metrics

            serve_metrics(options["metrics_port"])
        Committer(options["name"]).run()
