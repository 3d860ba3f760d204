"""Build the agent wheel the join pages tell volunteers to install, from agent/ into CROWDTRAIN_AGENT_WHEEL_DIR.

./manage.py build_agent_wheel    # var/agent/crowdtrain_agent-<version>-py3-none-any.whl, served at /agent/<name>
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from crowdtrain.campaigns.agent_wheel import WheelBuildError, build_wheel


class Command(BaseCommand):
    help = "Build the agent wheel this site serves at /agent/<wheel> from agent/ (no network needed)."

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            path = build_wheel(Path(settings.CROWDTRAIN_AGENT_WHEEL_DIR))
        except WheelBuildError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"agent wheel built: {path}")
