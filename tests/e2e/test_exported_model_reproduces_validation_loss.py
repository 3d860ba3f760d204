"""Train a tiny GPT with LAMB on two aggregators, export a validated version over HTTP, reload it, recompute its loss.

Two agents train a byte-level GPT with LAMB (whole-tensor slices on two
aggregators) and a warmup + cosine schedule; the site validates every two
steps and at the finish. The test then signs in as the owner, downloads the
weights and config of the last version from the export endpoints, loads them
with ``load_exported`` and recomputes the loss on the held-out split with
plain PyTorch: it must equal the validation loss the progress feed shows.
"""

from __future__ import annotations

import itertools
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional as F

from crowdtrain.datasets.sharding import split_sizes, stdlib_corpus
from crowdtrain_agent.models import load_exported

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

STEPS = 4
CORPUS_BYTES = 64 << 10
MODEL = {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16}
SAMPLE_LEN = MODEL["block_size"] + 1
HELD_OUT = 0.1
OPTIMIZER = {
    "name": "lamb", "lr": 1e-2, "weight_decay": 0.01, "warmup_steps": 1, "schedule": "cosine", "min_lr_ratio": 0.1,
}  # fmt: skip
SITE_ENV = {"CROWDTRAIN_LEASE_TARGET_S": "0.1", "CROWDTRAIN_MAX_LEASE_SAMPLES": "16", "CROWDTRAIN_RETRY_AFTER_S": "0.1"}
# Signs the seeded owner in (the organizer role, a session in the child's database) and prints the session key.
SIGN_IN = (
    "from django.contrib.auth import get_user_model; from django.test import Client; "
    "from crowdtrain.campaigns.organizers import grant_role; "
    "u = get_user_model().objects.get(username='organizer'); grant_role(u); "
    "c = Client(); c.force_login(u); print(c.cookies['sessionid'].value)"
)


def spec() -> dict[str, Any]:
    return {
        "campaigns": [{
            "name": "exported GPT", "architecture": "gpt", "model_config": MODEL, "optimizer": OPTIMIZER,
            "dataset": {"kind": "stdlib", "bytes": CORPUS_BYTES, "sample_len": SAMPLE_LEN, "shard_bytes": 16 << 10,
                        "validation_fraction": HELD_OUT},
            "target_batch_size": 64, "microbatch_size": 16, "codec": "fp32", "staleness": 0,
            "num_aggregators": 2, "max_steps": STEPS, "validate_every": 2, "seed": 11,
        }],
        "aggregators": ["agg-1", "agg-2"],
        "agents": ["agent-1", "agent-2"],
    }  # fmt: skip


def wait_for_val_loss(run: Any, version: int, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    progress: dict[str, Any] = {}
    while time.monotonic() < deadline:
        run.swarm.check()
        progress = run.progress()
        if any(v["version"] == version for v in progress["val_loss"]):
            return progress
        time.sleep(0.25)
    pytest.fail(f"no validation loss for version {version} in {timeout_s:.0f} s; last progress {progress}")


def download(url: str, session: str) -> bytes:
    request = urllib.request.Request(url, headers={"Cookie": f"sessionid={session}"})
    with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310 (loopback http only)
        return response.read()


def held_out_loss(model: torch.nn.Module) -> tuple[float, int]:
    """Plain PyTorch over the held-out split, rebuilt from the corpus: its last samples."""
    corpus = stdlib_corpus(CORPUS_BYTES)
    train, held_out = split_sizes(len(corpus) // SAMPLE_LEN, HELD_OUT)
    rows = torch.frombuffer(bytearray(corpus[train * SAMPLE_LEN : (train + held_out) * SAMPLE_LEN]), dtype=torch.uint8)
    tokens = rows.view(held_out, SAMPLE_LEN).long()
    total = 0.0
    with torch.no_grad():
        for batch in tokens.split(100):
            logits = model(batch[:, :-1])
            total += float(F.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1), reduction="sum"))
    return total / (held_out * (SAMPLE_LEN - 1)), held_out


def test_an_exported_model_reproduces_the_validation_loss_on_the_page(seeded_run: Any, tmp_path: Path) -> None:
    run = seeded_run(spec(), SITE_ENV)

    site = run.start(agents_first=True)
    run.wait_for_version(STEPS, timeout_s=120)
    progress = wait_for_val_loss(run, STEPS, timeout_s=60)
    session = run.swarm.manage("shell", "-c", SIGN_IN).strip().splitlines()[-1]
    base = f"{site.url}/campaigns/{run.campaign_id}/export"
    (tmp_path / "model.safetensors").write_bytes(download(f"{base}?version={STEPS}", session))
    config = json.loads(download(f"{base}/config.json?version={STEPS}", session))
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = load_exported(tmp_path / "model.safetensors", tmp_path / "config.json")
    loss, samples = held_out_loss(model)
    cuts = [s["start"] for s in run.dump()["slices"]]

    tensor_edges = set(itertools.accumulate((p.numel() for p in model.parameters()), initial=0))
    assert len(cuts) == 2 and set(cuts) <= tensor_edges, "LAMB slices hold whole tensors"
    shown = {v["version"]: v for v in progress["val_loss"]}
    assert sorted(shown) == [2, 4], "validated every 2 steps and at the finish"
    assert progress["state"] == "finished"
    assert config["version"] == STEPS and config["optimizer"]["name"] == "lamb"
    assert config["optimizer"]["total_steps"] == STEPS, "a cosine schedule ends at max_steps"
    assert shown[STEPS]["num_samples"] == samples == config["val_samples"]
    assert config["val_loss"] == shown[STEPS]["loss"]
    assert abs(loss - shown[STEPS]["loss"]) <= 1e-5 * abs(shown[STEPS]["loss"])
    assert shown[4]["loss"] < shown[2]["loss"], "the model learns"
