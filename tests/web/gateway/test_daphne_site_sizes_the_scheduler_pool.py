"""The served site runs the scheduler's blocking calls in a pool of CROWDTRAIN_SCHEDULER_THREADS threads.

Run in a child interpreter: importing daphne's server installs twisted's
asyncio reactor, which the test process must not get.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from crowdtrain_launcher import PYTHONPATH

CHILD = textwrap.dedent(
    """
    import json, threading
    import django

    django.setup()
    from crowdtrain.lib import daphne_site

    pool = daphne_site.use_scheduler_threads()
    from daphne.server import twisted_loop
    from crowdtrain.lib.offloop import offloop

    # A blocking call through offloop, as the consumers make one, on the loop daphne serves.
    ran_in = twisted_loop.run_until_complete(offloop(lambda: threading.current_thread().name)())
    print(json.dumps({"max_workers": pool._max_workers, "ran_in": ran_in}))
    """
)


def run_child(threads: str | None, database_url: str = "") -> dict[str, object]:
    env = {"PYTHONPATH": ":".join(str(p) for p in PYTHONPATH), "DJANGO_SETTINGS_MODULE": "crowdtrain.settings"}
    if database_url:
        env["DATABASE_URL"] = database_url  # read by the settings only: nothing connects
    if threads is not None:
        env["CROWDTRAIN_SCHEDULER_THREADS"] = threads
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_scheduler_calls_run_in_a_pool_of_the_configured_size() -> None:
    result = run_child("3")

    assert result["max_workers"] == 3
    assert str(result["ran_in"]).startswith("crowdtrain-scheduler")


def test_the_pool_has_16_threads_on_postgresql_unless_told_otherwise() -> None:
    assert run_child(None, "postgres://crowdtrain@127.0.0.1:5432/crowdtrain")["max_workers"] == 16


def test_on_sqlite_the_pool_keeps_asyncios_size_one_writer_at_a_time_needs_no_more() -> None:
    assert run_child(None)["max_workers"] == min(32, (os.cpu_count() or 1) + 4)
