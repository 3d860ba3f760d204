"""Today's agents and aggregators train against a site that speaks the previous protocol minor.

A site pinned one minor back (``CROWDTRAIN_PROTOCOL_MINOR``, as during a
rolling upgrade) accepts their offered subprotocols at its own minor; they
leave out of what they send the fields it does not know, and the run is
still exactly plain PyTorch's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from websockets.sync.client import connect

from crowdtrain_agent.protocol import PROTOCOL_MINOR, offered_subprotocols
from tests.e2e.test_two_aggregators_match_plain_pytorch import (
    SITE_ENV,
    TICKET_KEY,
    platform_params,
    rerun_in_pytorch,
    spec,
    write_dataset,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

STEPS = 8


def test_new_agents_and_aggregators_train_against_a_site_one_minor_back(seeded_run: Any, tmp_path: Path) -> None:
    npz = tmp_path / "projection.npz"
    write_dataset(npz)
    campaign_spec = spec(npz)
    campaign_spec["campaigns"][0].update(max_steps=STEPS)
    run = seeded_run(campaign_spec, {**SITE_ENV, "CROWDTRAIN_PROTOCOL_MINOR": str(PROTOCOL_MINOR - 1)})
    site = run.start(agents_first=True)
    run.wait_for_version(STEPS, timeout_s=120)
    dump = run.dump()

    # What the site chose when today's client offered its minors: the previous one.
    ws_url = site.url.replace("http://", "ws://") + "/ws/agent/"
    token = run.seed["agents"]["agent-1"]
    with connect(ws_url, additional_headers={"Authorization": f"Bearer {token}"},
                 subprotocols=offered_subprotocols()) as ws:  # fmt: skip
        chosen = ws.subprotocol
    assert chosen == f"crowdtrain.2.{PROTOCOL_MINOR - 1}"

    reference, _ = rerun_in_pytorch(dump, STEPS)
    # 2.0 has one site-wide ticket key; since 2.1 each campaign has its own (the default).
    platform = platform_params(dump, STEPS, key=TICKET_KEY if PROTOCOL_MINOR - 1 == 0 else None)
    error = float(torch.linalg.vector_norm(platform - reference) / torch.linalg.vector_norm(reference))
    assert error <= 1e-5, f"relative error {error:.3g} between the platform's and plain PyTorch's parameters"
