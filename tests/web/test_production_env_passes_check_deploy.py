"""deploy/production.env.example is a complete production configuration: `manage.py check --deploy` passes with it.

Each case runs manage.py in a child process, because settings are read from the
environment once, at start-up, which is what is under test.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy" / "production.env.example"
# Variables of this test run that would otherwise mix into the example's (make test's second pass sets some).
OURS = ("CROWDTRAIN_", "DATABASE_URL", "REDIS_URL", "CELERY_", "EMAIL_", "DEFAULT_FROM_EMAIL")


def example_env() -> dict[str, str]:
    lines = [line for line in EXAMPLE.read_text().splitlines() if line.strip() and not line.startswith("#")]
    return dict(line.split("=", 1) for line in lines)


def check_deploy(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    inherited = {name: value for name, value in os.environ.items() if not name.startswith(OURS)}
    return subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT, env={**inherited, **env}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_the_example_with_a_secret_filled_in_passes_every_deploy_check() -> None:
    env = {**example_env(), "CROWDTRAIN_SECRET_KEY": secrets.token_urlsafe(50)}

    result = check_deploy(env)

    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


def test_without_a_secret_check_deploy_fails_naming_it() -> None:
    env = example_env()
    del env["CROWDTRAIN_SECRET_KEY"]

    result = check_deploy(env)

    assert result.returncode != 0
    assert "crowdtrain.E001" in result.stderr and "CROWDTRAIN_SECRET_KEY" in result.stderr


def test_the_example_as_shipped_stops_on_its_empty_secret() -> None:
    result = check_deploy(example_env())

    assert result.returncode != 0
    assert "CROWDTRAIN_SECRET_KEY is empty" in result.stderr
