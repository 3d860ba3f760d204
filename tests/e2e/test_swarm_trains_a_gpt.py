"""The real programs on loopback: daphne, one aggregator and two agents train a small GPT for a few steps."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

STEPS = 8
SPEC = {
    "campaigns": [{
        "name": "tiny GPT", "architecture": "gpt",
        "model_config": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32},
        "dataset": {"kind": "stdlib", "bytes": 512 << 10, "sample_len": 33, "shard_bytes": 64 << 10},
        "optimizer": {"name": "adamw", "lr": 1e-2}, "target_batch_size": 64, "microbatch_size": 16,
        "staleness": 1, "max_steps": STEPS, "seed": 7,
        # No verification copies: with two agents a copy of one's lease can take the other's whole share of
        # a short run, and this test is about both agents' leases making steps (tests/trust checks copies).
        "check_fraction": 0.0,
    }],
    "aggregators": ["agg-1"],
    "agents": ["agent-1", "agent-2"],
}  # fmt: skip
# Leases of at most half a step, so steps are made of several leases from both agents.
SITE_ENV = {"CROWDTRAIN_LEASE_TARGET_S": "0.3", "CROWDTRAIN_MAX_LEASE_SAMPLES": "32"}


def counted_samples(dump: dict[str, Any]) -> Counter[tuple[int, int, int]]:
    """How often each (epoch, shard, sample) was counted in a committed step."""
    seen: Counter[tuple[int, int, int]] = Counter()
    for step in dump["steps"]:
        for lease in step["leases"]:
            for epoch, shard, start, count in lease["ranges"]:
                seen.update((epoch, shard, i) for i in range(start, start + count))
    return seen


def test_it_trains_until_max_steps_with_falling_loss_counting_each_sample_once(seeded_run: Any) -> None:
    run = seeded_run(SPEC, SITE_ENV)

    run.start(agents_first=True)  # both ask from the first step: a short run must not end before one is up
    progress = run.wait_for_version(STEPS, timeout_s=90)
    dump = run.dump()

    losses = progress["losses"]
    assert progress["state"] == "finished"
    assert len(losses) == STEPS
    assert sum(losses[-2:]) / 2 < losses[0] - 0.3, f"loss did not fall: {losses}"
    seen = counted_samples(dump)
    assert max(seen.values()) == 1, f"samples counted twice: {[k for k, n in seen.items() if n > 1][:5]}"
    assert sum(seen.values()) == sum(step["num_samples"] for step in dump["steps"])
    assert all(step["num_samples"] >= SPEC["campaigns"][0]["target_batch_size"] for step in dump["steps"])
    assert all(len(step["leases"]) >= 2 for step in dump["steps"])
    assert progress["contributors"] == 2, "both agents should have work in committed steps"
