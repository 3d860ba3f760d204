"""Run Crowdtrain's real programs on this machine.

The harness of the demo, the tests, the benchmarks and ``make cluster``.

Not part of the site, the aggregator or the agent: it starts them as child processes
(``swarm``), puts several site processes behind HAProxy (``cluster``), and finds or
starts the engines under them (``engines``). It never imports Django, so it runs
before any settings exist::

    from crowdtrain_launcher import Swarm

    with Swarm(Path("var/run")) as swarm:
        site = swarm.start_site()
"""

from __future__ import annotations

from .swarm import PYTHONPATH, REPO_ROOT, WORKER_READY, Child, LaunchError, Site, Swarm, child_env, get_json

__all__ = ["PYTHONPATH", "REPO_ROOT", "WORKER_READY", "Child", "LaunchError", "Site", "Swarm", "child_env", "get_json"]
