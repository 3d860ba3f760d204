"""Ctrl-C and SIGTERM end the installed agent with code 0 and nothing that looks like a crash.

The agent runs as volunteers run it (the ``crowdtrain-agent`` command of this
environment), pointed at a site that does not answer, so it waits to connect;
it is stopped with each signal, with a library thread still alive
(``lingering/sitecustomize.py``) as CUDA builds of PyTorch leave one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

LINGERING = str(Path(__file__).with_name("lingering"))
STARTED = "the agent keeps trying"  # its first warning: the signal handlers are in place by then


def _installed_agent() -> list[str]:
    script = Path(sys.executable).with_name("crowdtrain-agent")
    assert script.exists(), f"{script} is missing: make venv installs the agent's command"
    return [str(script)]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
@pytest.mark.parametrize("lingering", [False, True], ids=["plain", "with-a-lingering-thread"])
def test_a_stopped_agent_exits_with_code_0_and_no_noise(tmp_path: Path, sig: signal.Signals, lingering: bool) -> None:
    env = {**os.environ, "CROWDTRAIN_AGENT_TOKEN": "ctd_nobody", "PYTHONUNBUFFERED": "1"}
    if lingering:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [LINGERING, env.get("PYTHONPATH")]))
    command = [*_installed_agent(), "run", "--server", "http://127.0.0.1:9", "--no-progress",
               "--cache-dir", str(tmp_path / "cache")]  # fmt: skip
    agent = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert agent.stdout is not None
    seen, deadline = "", time.monotonic() + 60
    while STARTED not in seen and time.monotonic() < deadline:
        line = agent.stdout.readline()
        if not line:
            break
        seen += line
    assert STARTED in seen, seen

    agent.send_signal(sig)
    try:
        rest, _ = agent.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        agent.kill()
        pytest.fail(f"the agent did not exit within 30 s of {sig.name}: {agent.communicate()[0][-2000:]}")
    output = seen + rest
    assert agent.returncode == 0, output
    for noise in ("Traceback", "terminate called", "Exception ignored", "Aborted"):
        assert noise not in output, output
    assert "stopping after the current lease" in output
