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

Volunteers who work together (``collude``: two accounts that joined within
minutes of each other upload the same made-up gradient) meet the referee,
the site's own recomputation, whenever they dispute an honest volunteer's
result or check each other's: the honest volunteers are never quarantined,
the colluders are, no credit stays with made-up work; the same with a flipper
beside the pair. Three hostile newcomers of five are half of every early step,
which no robust rule outvotes: what bounds their harm is how few of their leases
reach steps. From its first disagreement a newcomer is held to copies until the
referee rules (``verification.standing.held``), so that count is a few per account
however slow the referee is (without the hold a CI run let 26 through and ended
10% above the honest loss), and the loss stays within ``COLLUSION_LOSS_RATIO``.

Runs in ``make test`` on its own after the first pass (the embedded default, with no other test
beside it: the harm bound assumes the referee has the machine's cores): it is about the trust
model, which the second pass's engines do not change.
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
    # Once hostile accounts are quarantined, fewer volunteers are left than a step has leases, all on probation:
    # a step that waited this long takes more of theirs (steps here take a fraction of a second).
    "CROWDTRAIN_PROBATION_RELIEF_S": "2",
}
HOSTILE_PATH = str(Path(__file__).with_name("hostile"))


HEAD_START_S = 8.0
SETTLE_S = 60.0
UNSETTLED = ("referee",)  # an open check waits for a copy (up to CROWDTRAIN_CHECK_WAIT_S): not waited for
COLLUDERS_JOINED_S_AGO = 7200.0  # both accounts, within the same ten minutes; the honest ones half-hours apart
# Leases of each hostile account that may reach steps before its first disagreement holds it: its first lease,
# and what it computes while a copy of that lease is made (1 to 5 for three accounts in 8 runs here).
LEASES_BEFORE_HELD = 3
# With three of five volunteers hostile the final loss of this 40-step run swings both ways, whatever the harm:
# with 1 to 5 hostile leases in steps it ended 0.959 to 1.070 of the honest run's in 8 runs here (mean 0.99),
# and honest runs whose seed alone differs end 3.3% apart. 1.10 is past that noise; an attack left to run
# (never held, never quarantined) is not: a flipper alone that filled the steps ended 5.6 times the honest loss.
COLLUSION_LOSS_RATIO = 1.10


def train(
    seeded_run: Any, modes: dict[str, str], *, hostile_first: bool = False, name: str = ""
) -> tuple[float, dict[str, Any], float]:
    """One run to the last step with each agent of ``modes`` tampered with (none: the honest run).

    ``hostile_first``: the hostile agents start ``HEAD_START_S`` before the others. Returns the final
    validation loss, the run's dump and how long it took.
    """
    spec = dict(SPEC)
    colluders = [agent for agent, mode in modes.items() if mode == "collude"]
    spec["joined_s_ago"] = dict.fromkeys(colluders, COLLUDERS_JOINED_S_AGO)
    run: Run = seeded_run(spec, SITE_ENV, name=name or "honest")
    started = time.monotonic()
    site = run.site = run.swarm.start_site()
    run.swarm.start_aggregators(site, run.seed["aggregators"])
    agents = sorted(run.seed["agents"].items(), key=lambda item: (not hostile_first or item[0] not in modes, item[0]))
    for agent, token in agents:
        mode = modes.get(agent, "")
        env = {"PYTHONPATH": HOSTILE_PATH, "CROWDTRAIN_TEST_HOSTILE": mode} if mode else {}
        run.swarm.start_agent(site, token=token, name=agent, threads=1, campaign_id=run.campaign_id, env=env)
        if hostile_first and mode and agent == max(modes):
            time.sleep(HEAD_START_S)
    progress = run.wait_for_version(STEPS, timeout_s=400)
    deadline = time.monotonic() + 60
    while not any(v["version"] == STEPS for v in progress["val_loss"]) and time.monotonic() < deadline:
        time.sleep(0.5)
        progress = run.progress()
    finals = [v["loss"] for v in progress["val_loss"] if v["version"] == STEPS]
    assert finals, f"no validation loss at version {STEPS}: {progress['val_loss']}"
    # Disputes still before the referee are ruled after the last step (on two loaded cores the referee runs
    # behind the training): the verdicts are read once the site has none left, or after SETTLE_S.
    dump = run.dump()
    settle = time.monotonic() + SETTLE_S
    while any(c["state"] in UNSETTLED for c in dump["checks"]) and time.monotonic() < settle:
        time.sleep(1.0)
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
        honest_loss["loss"] = train(seeded_run, {})[0]
    mode, _, first = mode.partition(" ")
    loss, dump, took = train(
        seeded_run, {HOSTILE.removeprefix("volunteer-"): mode}, hostile_first=bool(first), name=mode
    )
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
    # Quarantined once it crossed the line (2 lost rulings), every one of its checked results disagreeing with the
    # referee's. The count is read when the rule runs: a ruling settled by another process meanwhile can make it 3.
    counted = re.match(r"^(\d+) of (\d+) of its results the site recomputed disagreed", standing["reason"])
    assert counted and counted[1] == counted[2], f"every checked result disagreed: {standing['reason']}"
    assert int(counted[1]) >= 2, f"quarantined only past its second lost ruling: {standing['reason']}"
    assert not [a for a in decided if a[2] == "agreed"], "a hostile answer never agrees with the referee"


COLLUSIONS = {
    "colluders": {"volunteer-agent-4": "collude", "volunteer-agent-5": "collude"},
    "colluders and a flipper": {
        "volunteer-agent-3": "flip",
        "volunteer-agent-4": "collude",
        "volunteer-agent-5": "collude",
    },
}


@pytest.mark.parametrize("scenario", list(COLLUSIONS))
def test_colluding_volunteers_cannot_outvote_an_honest_one(
    seeded_run: Any, honest_loss: dict[str, float], scenario: str
) -> None:
    if "loss" not in honest_loss:
        honest_loss["loss"] = train(seeded_run, {})[0]
    hostile = COLLUSIONS[scenario]
    modes = {volunteer.removeprefix("volunteer-"): mode for volunteer, mode in hostile.items()}
    loss, dump, took = train(seeded_run, modes, name=scenario.replace(" ", "-"))
    ratio = loss / honest_loss["loss"]
    volunteers = [f"volunteer-agent-{i}" for i in range(1, 6)]
    honest = [v for v in volunteers if v not in hostile]
    standings = {v: dump["standings"].get(v, {}) for v in volunteers}
    checks = dump["checks"]
    by_referee = [c for c in checks if c["detail"].startswith("referee:")]
    hostile_devices = {dump.get("devices", {}).get(v) for v in hostile}
    hostile_steps = [
        step["index"] for step in dump["steps"] for lease in step["leases"] if lease["device"] in hostile_devices
    ]
    in_steps = len(hostile_steps)
    print(
        f"\ntrust: scenario={scenario.replace(' ', '_')} val_loss honest={honest_loss['loss']:.4f} "
        f"with_hostile={loss:.4f} ratio={ratio:.3f} rulings={len(by_referee)} hostile_leases_in_steps={in_steps} "
        + " ".join(
            f"{v.removeprefix('volunteer-')}={hostile.get(v, 'honest')}:{standings[v].get('state', 'good')}"
            f":won={standings[v].get('rulings_won', 0)}:lost={standings[v].get('rulings_lost', 0)}"
            f":credit={dump['credit'].get(v, 0)}"
            for v in volunteers
        )
        + f" run_s={took:.0f} hostile_in_steps={','.join(map(str, hostile_steps))}"
        + " checks="
        + ",".join(
            f"{v.removeprefix('volunteer-')}:{c['state']}" for c in checks for v in [c["volunteer"]] if v in hostile
        )
    )

    for volunteer in honest:
        assert standings[volunteer].get("state", "good") == "good", (volunteer, standings[volunteer])
        assert standings[volunteer].get("rulings_lost", 0) == 0, (volunteer, [c for c in checks if c["detail"]])
        assert standings[volunteer].get("failed", 0) == 0, standings[volunteer]
    assert sum(dump["credit"].get(v, 0) for v in honest) > 0, "honest volunteers must get credit"
    for volunteer in hostile:
        assert standings[volunteer].get("state") == "quarantined", (volunteer, standings[volunteer])
        # Quarantine took back whatever a colluder's copy had let through: no credit for made-up work.
        assert dump["credit"].get(volunteer, 0) == 0, [c for c in checks if c["volunteer"] == volunteer]
    assert in_steps <= LEASES_BEFORE_HELD * len(hostile), f"hostile leases reached steps {hostile_steps}"
    assert ratio <= COLLUSION_LOSS_RATIO, f"validation loss {loss:.4f} against {honest_loss['loss']:.4f} honest"


def _device(dump: dict[str, Any], username: str) -> int | None:
    return dump.get("devices", {}).get(username)
