"""kill -9 the site, then Redis, then PostgreSQL, each started again: agents and aggregators go on, nothing is lost.

The engines are private to this test (started from Debian's packages in its
folder, on their own ports), so killing them touches nothing else. After each
kill the test waits for training to advance again; at the end every committed
step is still there, every sample was committed once, and the parameters
equal a plain PyTorch replay of exactly the recorded steps.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest
import torch

from crowdtrain_launcher import Child, Swarm, engines
from tests.e2e.conftest import Run, seed
from tests.e2e.test_aggregator_stops_lose_nothing import samples_committed_once
from tests.e2e.test_two_aggregators_match_plain_pytorch import (
    SITE_ENV,
    platform_params,
    rerun_in_pytorch,
    spec,
    write_dataset,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

STEPS = 24


def _version(run: Run) -> int:
    try:
        return int(run.progress()["version"])
    except OSError:  # urllib's HTTPError and URLError
        return -1


def _kill(child: Child) -> None:
    child.expected_exit = True
    child.signal(signal.SIGKILL)
    child.popen.wait(15)


def test_training_survives_kill_9_of_the_site_redis_and_postgresql(tmp_path: Path) -> None:
    npz = tmp_path / "projection.npz"
    write_dataset(npz)
    campaign_spec = spec(npz)
    campaign_spec["campaigns"][0].update(max_steps=STEPS, checkpoint_every=4)

    # Not under tmp_path: the postgres user must reach its data folder, and pytest's folders are root's alone.
    pg_folder = Path(tempfile.mkdtemp(prefix="crowdtrain-e2e-pg-"))
    pg_bin, pg_data = engines.init_postgres(pg_folder)
    pg_port, redis_port = engines.free_port(), engines.free_port()
    database_url = f"postgres://postgres@127.0.0.1:{pg_port}/crowdtrain"
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    swarm = Swarm(tmp_path / "run", env={"CROWDTRAIN_VAR_DIR": str(tmp_path / "run" / "var"),
                                         "DATABASE_URL": database_url, "REDIS_URL": redis_url, **SITE_ENV})  # fmt: skip

    def start_postgres() -> Child:
        # After a kill -9 the old server's backends take a moment to notice and leave; until they
        # have, a new server refuses the data folder ("pre-existing shared memory block"): try again.
        deadline = time.monotonic() + 60
        while True:
            child = swarm.start("postgres", engines.postgres_argv(pg_bin, pg_data, pg_port), role="engine")
            try:
                engines.wait_until_answers(database_url, pg_port, "PostgreSQL", timeout_s=5)
                return child
            except engines.EngineError:
                child.expected_exit = True
                if child.alive() or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def start_redis() -> Child:
        child = swarm.start("redis", engines.redis_argv(redis_port), role="engine")
        engines.wait_until_answers(redis_url, redis_port, "Redis", timeout_s=30)
        return child

    with contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, pg_folder, ignore_errors=True)
        cleanup.enter_context(swarm)
        postgres, redis = start_postgres(), start_redis()
        engines.create_database(database_url)
        run = Run(swarm, seed(swarm, campaign_spec, tmp_path / "spec.json"))
        site = run.start(agents_first=True)
        run.wait_for_version(4, timeout_s=90)

        _kill(site.child)
        swarm.children.remove(site.child)
        run.site = swarm.start_site(port=site.port, worker=False)  # agents and aggregators dial the same address
        after_site = run.progress()["committed_steps"]
        run.wait_for_version(after_site + 3, timeout_s=90)

        _kill(redis)
        redis = start_redis()  # empty: the site rebuilds the campaign's hot state from the database
        after_redis = run.progress()["committed_steps"]
        run.wait_for_version(after_redis + 3, timeout_s=90)

        _kill(postgres)
        postgres = start_postgres()
        # The progress page answers 500 while the database is away, as any page does; ask again.
        swarm.wait_until(lambda: _version(run) >= STEPS, timeout_s=120, what=f"version {STEPS}")
        dump = run.dump()
        platform = platform_params(dump, STEPS)  # from the aggregators, while they still run

    print(f"committed after the site's restart {after_site}, after Redis's {after_redis}; "
          f"rolled-back leases {dump['rolled_back_leases']}")  # fmt: skip
    assert [s["index"] for s in dump["steps"]] == list(range(len(dump["steps"])))
    assert len(dump["steps"]) >= STEPS
    assert dump["rolled_back_leases"] == 0, "no aggregator lost its state, so no step may be undone"
    samples_committed_once(dump)
    reference, _ = rerun_in_pytorch(dump, STEPS)
    error = float(torch.linalg.vector_norm(platform - reference) / torch.linalg.vector_norm(reference))
    assert error <= 1e-5, f"relative error {error:.3g} between the platform's and plain PyTorch's parameters"
