"""The proof of verification: five real agents train the demo's model, one of them hostile.

A hostile agent is the real agent with its gradients tampered with before upload
(``hostile/sitecustomize.py``): scaled and sign-flipped, random noise, or NaNs.
Each run is compared with a run of five honest agents on the same seed:

- a hostile volunteer whose uploads pass the aggregators' checks (flip, noise) is
  quarantined at its second failed check, the bound of the quarantine rule
  (``verification.standing.QUARANTINE_FAILURES``);
- a NaN gradient never gets past the aggregators, so it is in no step;
- either way the hostile volunteer ends with no credit, and the validation loss
  ends no more than 5% above the honest run's;
- the same when the hostile agent starts alone, seconds before the honest ones
  (``first``): on probation it holds one lease of a step, which the trimmed mean
  outvotes, and the steps wait for the others (a CI run once started the honest
  agents late by chance, and the hostile filled 139 of 160 leases).

Runs in ``make test``'s first pass only (the embedded default): it is about
the trust model, which the second pass's engines do not change.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Run

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

STEPS = 40
HOSTILE = "volunteer-agent-5"
SPEC: dict[str, Any] = {
    "campaigns": [{
        "name": "trust", "architecture": "gpt",
        "model_config": {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16},
        "dataset": {"kind": "stdlib", "bytes": 96 << 10, "sample_len": 17, "shard_bytes": 16 << 10,
                    "validation_fraction": 0.1},
        "optimizer": {"name": "adamw", "lr": 1e-2}, "target_batch_size": 64, "microbatch_size": 16,
        "staleness": 1, "max_steps": STEPS, "validate_every": STEPS, "seed": 5,
        # A newcomer's leases are checked at four times this rate: all of them here, until 10 checks passed.
        "check_fraction": 0.25,
        # Steps of 4 leases: the trimmed mean drops the highest and lowest of each coordinate.
        "aggregation": "trimmed_mean", "trim_fraction": 0.25,
    }],
    "aggregators": ["agg-1"],
    "agents": ["agent-1", "agent-2", "agent-3", "agent-4", "agent-5"],
}  # fmt: skip
SITE_ENV = {
    "CROWDTRAIN_LEASE_TARGET_S": "0.1",
    "CROWDTRAIN_MAX_LEASE_SAMPLES": "16",
    "CROWDTRAIN_RETRY_AFTER_S": "0.2",
}
HOSTILE_PATH = str(Path(__file__).with_name("hostile"))


HEAD_START_S = 8.0


def train(seeded_run: Any, mode: str, *, hostile_first: bool = False) -> tuple[float, dict[str, Any], float]:
    """One run to the last step with agent-5 ``mode`` ("" for honest); its final validation loss and dump.

    ``hostile_first``: agent-5 starts ``HEAD_START_S`` before the others.
    """
    run: Run = seeded_run(SPEC, SITE_ENV, name=mode or "honest")
    started = time.monotonic()
    site = run.site = run.swarm.start_site()
    run.swarm.start_aggregators(site, run.seed["aggregators"])
    agents = sorted(run.seed["agents"].items(), key=lambda item: (not hostile_first or item[0] != "agent-5", item[0]))
    for name, token in agents:
        env = {"PYTHONPATH": HOSTILE_PATH, "CROWDTRAIN_TEST_HOSTILE": mode} if mode and name == "agent-5" else {}
        run.swarm.start_agent(site, token=token, name=name, threads=1, campaign_id=run.campaign_id, env=env)
        if hostile_first and name == "agent-5":
            time.sleep(HEAD_START_S)
    progress = run.wait_for_version(STEPS, timeout_s=400)
    deadline = time.monotonic() + 60
    while not any(v["version"] == STEPS for v in progress["val_loss"]) and time.monotonic() < deadline:
        time.sleep(0.5)
        progress = run.progress()
    finals = [v["loss"] for v in progress["val_loss"] if v["version"] == STEPS]
    assert finals, f"no validation loss at version {STEPS}: {progress['val_loss']}"
    dump = run.dump()
    run.swarm.stop(grace_s=5.0)
    return finals[0], dump, time.monotonic() - started


@pytest.fixture(scope="module")
def honest_loss() -> dict[str, float]:
    """The honest run's loss, trained once for the three hostile runs (by the first that needs it)."""
    return {}


@pytest.mark.parametrize("mode", ["flip", "noise", "nan", "flip first"])
def test_a_hostile_volunteer_is_quarantined_uncredited_and_harmless(
    seeded_run: Any, honest_loss: dict[str, float], mode: str
) -> None:
    if "loss" not in honest_loss:
        honest_loss["loss"] = train(seeded_run, "")[0]
    mode, _, first = mode.partition(" ")
    loss, dump, took = train(seeded_run, mode, hostile_first=bool(first))
    hostile_leases = {
        lease["id"] for step in dump["steps"] for lease in step["leases"] if lease["device"] == _device(dump, HOSTILE)
    }
    standing = dump["standings"].get(HOSTILE, {})
    decided = [a for a in dump["answers"] if a[0] == HOSTILE and a[2] in ("agreed", "disagreed")]
    ratio = loss / honest_loss["loss"]
    print(
        f"\ntrust: mode={mode} val_loss honest={honest_loss['loss']:.4f} with_hostile={loss:.4f} ratio={ratio:.3f} "
        f"hostile_state={standing.get('state', 'good')} hostile_checks_failed={standing.get('failed', 0)} "
        f"hostile_uploads_refused={standing.get('refused', 0)} "
        f"hostile_checks_passed={standing.get('passed', 0)} hostile_leases_in_steps={len(hostile_leases)} "
        f"hostile_credit={dump['credit'].get(HOSTILE, 0)} run_s={took:.0f}"
    )

    # Its checks, with why each ended (a check ended without a verdict releases the lease's credit).
    assert dump["credit"].get(HOSTILE, 0) == 0, [c for c in dump["checks"] if c["volunteer"] == HOSTILE]
    # Harm is a higher loss. A lower one is no harm: the leases it got into steps before its quarantine
    # (up to 3 here) change the run's path, and a CI run once ended 5.2% below the honest run.
    assert ratio <= 1.05, f"validation loss {loss:.4f} against {honest_loss['loss']:.4f} honest"
    honest_credit = [dump["credit"].get(f"volunteer-agent-{i}", 0) for i in range(1, 5)]
    assert sum(honest_credit) > 0, "honest volunteers must get credit"
    assert standing.get("state") == "quarantined", standing
    if mode == "nan":
        assert not hostile_leases, "a NaN gradient must never reach a step"
        # Never checked (the aggregators refuse it first), so quarantined for the refusals themselves.
        refused = re.search(r"the aggregators refused (\d+) of its uploads", standing["reason"])
        assert refused and int(refused[1]) >= 2, standing["reason"]
        return
    # Quarantined once it crossed the line (2 failed checks), every one of its checked results disagreeing. The
    # count is read when the rule runs: a check settled by another process meanwhile can make it "3 of 3".
    counted = re.match(r"^(\d+) of (\d+) of its results disagreed", standing["reason"])
    assert counted and counted[1] == counted[2], f"every checked result disagreed: {standing['reason']}"
    assert int(counted[1]) >= 2, f"quarantined only past its second failed check: {standing['reason']}"
    assert not [a for a in decided if a[2] == "agreed"], "a hostile answer never agrees with honest ones"


def _device(dump: dict[str, Any], username: str) -> int | None:
    return dump.get("devices", {}).get(username)
