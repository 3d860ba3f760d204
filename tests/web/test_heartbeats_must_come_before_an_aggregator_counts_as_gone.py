"""A site asked to heartbeat its aggregators no faster than it gives up on them refuses to start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from django.test import override_settings

from crowdtrain.checks import check_liveness_settings

ROOT = Path(__file__).resolve().parents[2]


def test_the_defaults_pass() -> None:
    problems = check_liveness_settings()

    assert problems == []


def test_a_heartbeat_as_long_as_the_gone_interval_is_an_error_that_names_both_settings() -> None:
    with override_settings(CROWDTRAIN_HEARTBEAT_S=10.0, CROWDTRAIN_GONE_AFTER_S=10.0):
        problems = check_liveness_settings()

    assert [problem.id for problem in problems] == ["crowdtrain.E004"]
    assert "CROWDTRAIN_HEARTBEAT_S (10 s)" in problems[0].msg
    assert "CROWDTRAIN_GONE_AFTER_S (10 s)" in problems[0].msg
    assert "Lower CROWDTRAIN_HEARTBEAT_S or raise CROWDTRAIN_GONE_AFTER_S" in problems[0].hint


def test_daphne_refuses_to_start_with_it(tmp_path: Path) -> None:
    inherited = {name: value for name, value in os.environ.items() if not name.startswith("CROWDTRAIN_")}
    env = {
        **inherited, "CROWDTRAIN_VAR_DIR": str(tmp_path), "DJANGO_SETTINGS_MODULE": "crowdtrain.settings",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "platform"), str(ROOT / "agent" / "src"), str(ROOT)]),
        "CROWDTRAIN_HEARTBEAT_S": "12", "CROWDTRAIN_GONE_AFTER_S": "10",
    }  # fmt: skip

    result = subprocess.run(
        [sys.executable, "-m", "crowdtrain.lib.daphne_site", "-b", "127.0.0.1", "-p", "0"],
        check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip

    assert result.returncode != 0
    assert "crowdtrain.E004" in result.stderr
    assert "Listening" not in result.stderr + result.stdout
