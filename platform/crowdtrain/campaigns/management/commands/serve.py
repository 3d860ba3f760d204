"""Run the site on daphne in the foreground: HTTP, the agents' and aggregators' WebSockets, and Celery in-process.

    ./manage.py serve                    # http://127.0.0.1:8000/
    PORT=8080 ./manage.py serve
    ./manage.py serve --port 0           # a free port, printed

The embedded default needs nothing else: SQLite in var/, the in-memory
channel layer and Celery tasks run eagerly inside the request that queues
them. daphne's 1 MiB WebSocket limits stay: every protocol message is smaller.
Its keepalive drops sockets that go quiet and stop reading, as for the swarms
the launcher starts (``crowdtrain.lib.daphne_site`` says what that bounds).
"""

from __future__ import annotations

import os
import socket
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from crowdtrain.campaigns.agent_wheel import WheelBuildError, ensure_wheel, wheel_ready
from crowdtrain.lib import daphne_site


def free_port(host: str) -> int:
    """A port nobody listens on right now (daphne needs a number before it starts to print our URL)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


class Command(BaseCommand):
    help = "Serve the site with daphne in the foreground on 127.0.0.1 (port from --port, else $PORT, else 8000)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
        parser.add_argument("--port", help="port to bind; 0 picks a free one (default $PORT, else 8000)")

    def handle(self, *args: Any, **options: Any) -> None:
        raw = options["port"] if options["port"] is not None else os.getenv("PORT", "8000")
        try:
            port = int(raw)
        except ValueError:
            port = -1
        if not 0 <= port <= 65535:
            raise CommandError(f"port must be an integer 0-65535, got {raw!r} (from --port or $PORT)")
        host = options["host"]
        if port == 0:
            port = free_port(host)
        # The join pages link the agent wheel this site serves: build it now if it is missing, not at a
        # volunteer's first pip install (which would get a 503).
        if not wheel_ready():
            self.stdout.write("crowdtrain: building the agent wheel the join pages link (once; about 10 s)")
            self.stdout.flush()
            try:
                ensure_wheel()
            except WheelBuildError as exc:
                self.stderr.write(f"crowdtrain: cannot build the agent wheel ({exc}); join pages will say so")
        self.stdout.write(f"crowdtrain: serving http://{host}:{port}/ (Ctrl-C stops)")
        self.stdout.flush()
        daphne_site.main(["-b", host, "-p", str(port)])
