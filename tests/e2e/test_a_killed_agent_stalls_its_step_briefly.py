"""kill -9 an agent mid-lease: its lease goes back after the disconnect grace, not after the gone-timeout.

The site sees the agent's socket close at once; after
``CROWDTRAIN_DISCONNECT_GRACE_S`` (room for a reconnect) it releases the
agent's leases, and the other agent trains their samples. Here the
gone-timeout and the backup threshold are set far longer (30 s, 60 s), so
only the grace can explain a short stall: the longest pause between two
commits around the kill must stay near grace plus one lease.
"""

from __future__ import annotations

import re
import signal
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.datasets import write_projection_dataset
from tests.e2e.test_aggregator_stops_lose_nothing import samples_committed_once
from tests.e2e.test_two_aggregators_match_plain_pytorch import MODEL, SITE_ENV, spec

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

GRACE_S = 2.0
ENV = {**SITE_ENV, "CROWDTRAIN_DISCONNECT_GRACE_S": str(GRACE_S), "CROWDTRAIN_GONE_AFTER_S": "30",
       "CROWDTRAIN_BACKUP_MIN_S": "60"}  # fmt: skip
# Far more steps than the test waits for: the campaign must still be running through every kill below (eight
# kills take about a minute, 240 steps at this machine's pace), and the test stops it long before the end.
STEPS = 2000
WORKING = re.compile(r"lease \d+ done")  # an agent's line for a finished lease
AFTER_THE_KILL = 10  # steps committed after the kill that caught a lease, before the stall is read


def test_a_killed_agents_lease_is_redone_after_the_grace(seeded_run: Any, tmp_path: Path) -> None:
    npz = tmp_path / "projection.npz"
    write_projection_dataset(npz, 96 * 1000, MODEL)  # one epoch (1,000 steps) holds every step the test reaches
    campaign_spec = spec(npz)
    campaign_spec["campaigns"][0].update(max_steps=STEPS, num_aggregators=1)
    campaign_spec["aggregators"] = ["agg-1"]
    run = seeded_run(campaign_spec, ENV)
    run.start(agents_first=True)
    run.wait_for_version(5, timeout_s=90)

    # An agent spends part of its time waiting for room in the next step, holding nothing: kill it
    # until one kill catches it holding a lease (the site then releases it), and time that one.
    killed_at, released = 0.0, 0
    for attempt in range(8):
        victim = next(c for c in reversed(run.swarm.children) if c.name == "agent-1")
        victim.expected_exit = True
        time.sleep(1.0 + 0.37 * attempt)
        killed_at = time.time()
        victim.signal(signal.SIGKILL)
        time.sleep(GRACE_S + 2.0)
        state = run.dump()
        assert state["committed_steps"] < STEPS, "the campaign finished before a kill caught a lease; raise STEPS"
        released = state["lease_states"].get("released", 0)
        if released:
            break
        restarted = run.swarm.start_agent(run.site, token=run.seed["agents"]["agent-1"], name="agent-1", threads=1,
                                          campaign_id=run.campaign_id)  # fmt: skip
        # Working again before the next kill: on a busy machine its start (torch's import) took longer than
        # the pause below, and seven kills in a row caught an agent that had not connected yet.
        restarted.wait_for_line(WORKING, timeout_s=60)
    assert released, "no kill caught the agent holding a lease"
    run.wait_for_version(state["committed_steps"] + AFTER_THE_KILL, timeout_s=120)
    dump = run.dump()

    commits = [datetime.fromisoformat(s["committed_at"]).timestamp() for s in dump["steps"]]
    after = [t for t in commits if t > killed_at]
    stall = after[0] - killed_at if after else float("inf")
    print(f"first commit {stall:.2f} s after the kill that caught a lease (grace {GRACE_S} s; gone-timeout 30 s)")
    assert stall < GRACE_S + 4.0, f"the step waited {stall:.1f} s on a dead agent's lease"
    samples_committed_once(dump)
