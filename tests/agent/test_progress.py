"""The live panel shows what the volunteer needs: campaign, version, lease, speed, loss, and why it waits."""

from __future__ import annotations

import io

from rich.console import Console

from crowdtrain_agent.progress import AgentStatus, LiveProgress, render_status


def test_panel_shows_campaign_progress_and_why_the_agent_waits() -> None:
    status = AgentStatus(
        device="cpu: test", campaign_id=7, version=12, lease_id=3, samples_per_s=250.0, last_loss=2.5, accepted=4
    )
    status.set_status("waiting for work (step full: step 3 is full)")
    console = Console(record=True, width=100, file=io.StringIO())

    console.print(render_status(status))

    text = console.export_text()
    for expected in ("7", "12", "250.0", "2.5000", "4 accepted", "waiting for work (step full: step 3 is full)"):
        assert expected in text


def test_live_panel_starts_and_stops_on_a_terminal() -> None:
    out = io.StringIO()
    status = AgentStatus()

    with LiveProgress(status, Console(file=out, force_terminal=True, width=80)):
        status.set_status("computing lease 1 (8 samples)")

    assert "computing lease 1" in out.getvalue()


def test_panel_says_how_the_device_meets_its_memory_wall() -> None:
    quiet = Console(record=True, width=120, file=io.StringIO())
    quiet.print(render_status(AgentStatus()))
    assert "memory" not in quiet.export_text()  # nothing happened: nothing to say
    status = AgentStatus(out_of_memory=2, memory="microbatches of 4 (the campaign asks 16), activation checkpointing")
    console = Console(record=True, width=160, file=io.StringIO())

    console.print(render_status(status))

    text = console.export_text()
    assert "microbatches of 4 (the campaign asks 16), activation checkpointing" in text
    assert "2 out-of-memory error(s) recovered" in text
