"""The site's daphne walks its connections every few seconds, not every second, and still reaps them.

Run in a child interpreter: importing daphne's server installs twisted's
asyncio reactor, which the test process must not get.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from crowdtrain.lib.patches import REAP_EVERY_S
from crowdtrain_launcher import PYTHONPATH

CHILD = textwrap.dedent(
    """
    import asyncio, json, time
    from crowdtrain.lib import daphne_site
    from crowdtrain.lib.patches import REAP_EVERY_S

    server = daphne_site.server_class()(application=None, endpoints=["tcp:port=0"])
    from twisted.internet import reactor  # daphne's asyncio reactor, installed by the line above

    scheduled = []
    reactor.callLater = lambda delay, fn, *a, **k: scheduled.append(delay)
    loop = asyncio.new_event_loop()
    done = loop.create_future()
    done.set_result(None)
    # A socket that closed long ago and whose consumer has finished: what the walk exists to drop.
    server.connections = {"closed": {"disconnected": time.time() - 60, "application_instance": done}}
    remaining = []
    for _ in range(REAP_EVERY_S):
        server.application_checker()
        remaining.append(len(server.connections))
    print(json.dumps({"remaining": remaining, "scheduled": scheduled}))
    """
)


def test_the_walk_over_connections_runs_every_few_seconds_and_reaps_finished_ones() -> None:
    env = {"PYTHONPATH": ":".join(str(p) for p in PYTHONPATH), "DJANGO_SETTINGS_MODULE": "crowdtrain.settings"}
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    ticks = REAP_EVERY_S
    # Untouched on the skipped ticks, dropped on the one that walks; every tick schedules the next, a second on.
    assert result["remaining"] == [1] * (ticks - 1) + [0]
    assert result["scheduled"] == [1] * ticks
