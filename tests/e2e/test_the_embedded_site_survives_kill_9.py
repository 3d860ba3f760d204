"""kill -9 the site on the embedded default (SQLite, the scheduler's state in the process itself), then start
it again: the site rebuilds its scheduling state from the database, agents and aggregators reconnect, training
goes on, and no sample is lost or counted twice.

The PostgreSQL and Redis deployment has the same test with its engines killed too
(``test_site_redis_and_postgres_killed``); here nothing outlives the site process but the SQLite file.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import torch

from crowdtrain_launcher import Swarm
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

STEPS = 20


def test_training_on_sqlite_survives_kill_9_of_the_site(tmp_path: Path) -> None:
    npz = tmp_path / "projection.npz"
    write_dataset(npz)
    campaign_spec = spec(npz)
    campaign_spec["campaigns"][0].update(max_steps=STEPS, checkpoint_every=4)
    # Isolated: no DATABASE_URL or REDIS_URL reaches the children, whatever pass this runs in.
    swarm = Swarm(tmp_path / "run", env={"CROWDTRAIN_VAR_DIR": str(tmp_path / "run" / "var"), **SITE_ENV})

    with swarm:
        run = Run(swarm, seed(swarm, campaign_spec, tmp_path / "spec.json"))
        site = run.start(agents_first=True)
        run.wait_for_version(4, timeout_s=90)

        site.child.expected_exit = True
        site.child.signal(signal.SIGKILL)
        site.child.popen.wait(15)
        killed_at = time.monotonic()
        swarm.children.remove(site.child)
        run.site = swarm.start_site(port=site.port)  # agents and aggregators dial the same address
        after_kill = run.progress()["committed_steps"]
        run.wait_for_version(after_kill + 3, timeout_s=90)
        stall_s = time.monotonic() - killed_at
        run.wait_for_version(STEPS, timeout_s=120)
        dump = run.dump()
        platform = platform_params(dump, STEPS)

    print(f"committed when the site came back: {after_kill}; three more steps {stall_s:.1f} s after the kill")
    assert [s["index"] for s in dump["steps"]] == list(range(len(dump["steps"])))
    assert len(dump["steps"]) >= STEPS
    assert dump["rolled_back_leases"] == 0, "no aggregator lost its state, so no step may be undone"
    samples_committed_once(dump)
    reference, _ = rerun_in_pytorch(dump, STEPS)
    error = float(torch.linalg.vector_norm(platform - reference) / torch.linalg.vector_norm(reference))
    assert error <= 1e-5, f"relative error {error:.3g} between the platform's and plain PyTorch's parameters"
