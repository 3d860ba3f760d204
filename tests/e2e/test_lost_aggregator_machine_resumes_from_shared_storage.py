"""An aggregator's machine dies for good: its replacement, on an empty disk, resumes from the shared bucket.

Both aggregators keep their checkpoints in one S3-compatible bucket (moto's
server, over real HTTP). ``kill -9`` one mid-training, delete its local
folder, and start a replacement under the same name: the site resumes the
campaign from the newest version every slice has a confirmed checkpoint of.
At most ``checkpoint_every`` steps are redone, the campaign never goes back
to its initial weights, every sample is committed once, and the parameters
equal a plain PyTorch replay of the recorded steps.
"""

from __future__ import annotations

import re
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.e2e.test_aggregator_stops_lose_nothing import samples_committed_once
from tests.e2e.test_two_aggregators_match_plain_pytorch import (
    SITE_ENV,
    platform_params,
    rerun_in_pytorch,
    spec,
    write_dataset,
)
from tests.s3server import s3_server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

STEPS = 16
CHECKPOINT_EVERY = 4


def test_a_replacement_on_an_empty_disk_resumes_from_the_newest_complete_checkpoint(
    seeded_run: Any, tmp_path: Path
) -> None:
    npz = tmp_path / "projection.npz"
    write_dataset(npz)
    campaign_spec = spec(npz)
    campaign_spec["campaigns"][0].update(max_steps=STEPS, checkpoint_every=CHECKPOINT_EVERY)
    with s3_server(tmp_path / "s3") as s3_env:
        storage = {**s3_env, "CROWDTRAIN_BACKBONE_CHECKPOINT_URL": f"s3://{s3_env['CROWDTRAIN_S3_BUCKET']}/checkpoints"}
        run = seeded_run(campaign_spec, SITE_ENV)
        site = run.swarm.start_site()
        tokens = run.seed["aggregators"]
        for name in run.seed["agents"]:
            run.swarm.start_agent(site, token=run.seed["agents"][name], name=name, campaign_id=run.campaign_id)
        run.swarm.start_aggregators(site, tokens, env=storage)
        run.site = site
        run.wait_for_version(2 * CHECKPOINT_EVERY + 1, timeout_s=90)

        victim = next(c for c in run.swarm.children if c.name == "agg-1")
        victim.expected_exit = True
        victim.signal(signal.SIGKILL)
        victim.popen.wait(10)
        before = run.progress()["committed_steps"]
        shutil.rmtree(run.swarm.run_dir / "checkpoints" / "agg-1", ignore_errors=True)  # the machine is gone

        run.swarm.start_aggregator(site, token=tokens["agg-1"], name="agg-1", env=storage)
        run.wait_for_version(STEPS, timeout_s=150)
        dump = run.dump()

    assert [s["index"] for s in dump["steps"]] == list(range(len(dump["steps"])))
    log = (run.swarm.logs / "site.log").read_text(errors="replace")
    rolled_to = [int(v) for v in re.findall(r"rolled back to version (\d+)", log)]
    resumed_at = min(rolled_to, default=before)
    print(f"lost to the kill: {before - resumed_at} steps (committed {before}, resumed at {resumed_at})")
    assert before - resumed_at <= CHECKPOINT_EVERY, (rolled_to, before)
    assert resumed_at > 0, "the campaign went back to its initial weights"
    assert dump["blocked_reason"] == ""
    samples_committed_once(dump)
    reference, _ = rerun_in_pytorch(dump, STEPS)
    platform = platform_params(dump, STEPS)
    error = float(torch.linalg.vector_norm(platform - reference) / torch.linalg.vector_norm(reference))
    assert error <= 1e-5, f"relative error {error:.3g} between the platform's and plain PyTorch's parameters"
