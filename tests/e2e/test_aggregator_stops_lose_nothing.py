"""Stopping an aggregator the documented way loses no step; a bad checkpoint location never starts one.

Two aggregators, two agents, a real site. One aggregator gets SIGTERM in the
middle of training (as ``docker stop`` or systemd sends it) and is started
again: it applies the commits on their way, checkpoints its slice at its
current version with the uploads no commit has named yet, and on restart
resumes there with them, so the site rolls nothing back. Then
the same aggregator is started with a regular file as its checkpoint folder:
it refuses with status 2 and a message, and neither the campaign nor the
other aggregator's checkpoints change. Afterwards the committed steps still
equal a plain PyTorch replay of exactly the recorded sample ranges.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.e2e.test_two_aggregators_match_plain_pytorch import (
    SITE_ENV,
    platform_params,
    rerun_in_pytorch,
    spec,
    write_dataset,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

STEPS = 16
CHECKPOINT_EVERY = 4


def samples_committed_once(dump: dict[str, Any]) -> None:
    """Exactly once: no sample is in two committed steps."""
    seen: set[tuple[str, int]] = set()
    for step in dump["steps"]:
        for sha, start, count in step["ranges"]:
            for i in range(start, start + count):
                assert (sha, i) not in seen, f"sample {i} of shard {sha[:8]} committed twice"
                seen.add((sha, i))


def test_sigterm_loses_no_step_and_an_unusable_checkpoint_folder_is_refused(seeded_run: Any, tmp_path: Path) -> None:
    npz = tmp_path / "projection.npz"
    write_dataset(npz)
    campaign_spec = spec(npz)
    campaign_spec["campaigns"][0].update(max_steps=STEPS, checkpoint_every=CHECKPOINT_EVERY)
    run = seeded_run(campaign_spec, SITE_ENV)
    site = run.start(agents_first=True)
    aggregator = next(c for c in run.swarm.children if c.name == "agg-1")
    run.wait_for_version(5, timeout_s=90)

    # SIGTERM: the step in hand is finished and checkpointed, the process exits 0.
    aggregator.expected_exit = True
    aggregator.signal(signal.SIGTERM)
    assert aggregator.popen.wait(30) == 0, aggregator.log_tail()
    log = aggregator.log_path.read_text()
    stopped = re.search(
        r"stopping: 1 slice checkpoint\(s\) of the current version written and reported, with "
        r"(\d+) pending upload",
        log,
    )
    assert stopped, log[-2000:]
    before = run.progress()["committed_steps"]

    # A checkpoint "folder" that is a regular file: refused before it talks to the site.
    other_checkpoints = sorted((run.swarm.run_dir / "checkpoints" / "agg-2").rglob("v*.pt"))
    not_a_folder = tmp_path / "not-a-folder"
    not_a_folder.write_text("x")
    refused = run.swarm.start(
        "agg-1-bad", [run.swarm.python, "-m", "crowdtrain_backbone", "--site", site.url, "--name", "agg-1",
                      "--port", "0", "--checkpoint-dir", str(not_a_folder)],
        role="aggregator", env={"CROWDTRAIN_BACKBONE_TOKEN": run.seed["aggregators"]["agg-1"]}, expected_exit=True,
    )  # fmt: skip
    assert refused.popen.wait(60) == 2
    assert "is not a writable folder" in refused.log_path.read_text()
    time.sleep(1.0)
    assert run.progress()["committed_steps"] == before
    assert sorted((run.swarm.run_dir / "checkpoints" / "agg-2").rglob("v*.pt")) == other_checkpoints
    assert other_checkpoints, "the other aggregator should have checkpoints by now"

    # Started again the ordinary way: it resumes from its own checkpoint and training goes on.
    run.swarm.start_aggregator(site, token=run.seed["aggregators"]["agg-1"], name="agg-1")
    run.wait_for_version(STEPS, timeout_s=120)
    dump = run.dump()

    # The stopped process saved the uploads of the step in hand with its checkpoint: that step commits
    # on the restarted one, and nothing is redone.
    log = (run.swarm.logs / "site.log").read_text(errors="replace")
    rolled_to = [int(v) for v in re.findall(r"rolled back to version (\d+)", log)]
    assert (dump["rolled_back_leases"], rolled_to) == (0, []), f"committed {before} steps at the stop"
    assert dump["blocked_reason"] == ""
    samples_committed_once(dump)
    reference, _ = rerun_in_pytorch(dump, STEPS)
    platform = platform_params(dump, STEPS)
    error = float(torch.linalg.vector_norm(platform - reference) / torch.linalg.vector_norm(reference))
    assert error <= 1e-5, f"relative error {error:.3g} between the platform's and plain PyTorch's parameters"
