"""The command line prints exactly one parseable line with the real port, and refuses bad config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CROWDTRAIN_BACKBONE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "platform"), str(ROOT / "agent" / "src")])
    return env


def test_it_prints_the_listening_line_with_the_real_port(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "crowdtrain_backbone",
        "--site",
        "http://127.0.0.1:9",
        "--token",
        "t",
        "--name",
        "agg-cli",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--checkpoint-dir",
        str(tmp_path),
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=_env())
    try:
        assert process.stdout is not None
        line = process.stdout.readline().strip()

        prefix = "crowdtrain-backbone: listening on http://127.0.0.1:"
        assert line.startswith(prefix) and int(line[len(prefix) :]) > 0
        with urllib.request.urlopen(f"{line.split(' on ')[1]}/healthz", timeout=10) as resp:
            assert json.load(resp)["name"] == "agg-cli"
    finally:
        process.terminate()
        assert process.wait(timeout=10) == 0
    assert process.stdout.read() == ""  # exactly one line


def test_it_refuses_to_start_with_a_bad_port() -> None:
    env = _env() | {"CROWDTRAIN_BACKBONE_PORT": "eighty"}

    result = subprocess.run(
        [sys.executable, "-m", "crowdtrain_backbone", "--token", "t"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )

    assert result.returncode == 2
    assert "CROWDTRAIN_BACKBONE_PORT='eighty' is not a TCP port" in result.stderr
    assert result.stdout == ""
