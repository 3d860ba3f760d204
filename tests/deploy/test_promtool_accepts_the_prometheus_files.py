"""promtool, from the Prometheus that deploy/compose.yaml runs, accepts deploy/prometheus/'s config and rules."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from .promql import ALERT_RULES, COMPOSE_TOKEN_FILE, PROMTOOL, SCRAPE_CONFIG, binary


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([binary(PROMTOOL), *args], capture_output=True, text=True, timeout=60)


def test_promtool_accepts_the_scrape_config(tmp_path: Path) -> None:
    # promtool opens the token file the config names; compose mounts it at /etc/prometheus/.
    token = tmp_path / "metrics_token"
    token.write_text("a-token\n")
    config = tmp_path / "prometheus.yml"
    assert COMPOSE_TOKEN_FILE in SCRAPE_CONFIG.read_text()
    config.write_text(SCRAPE_CONFIG.read_text().replace(COMPOSE_TOKEN_FILE, str(token)))
    shutil.copy(ALERT_RULES, tmp_path / "alerts.yml")  # rule_files are relative to the config, as in compose

    result = promtool("check", "config", str(config))

    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 1 rule files found" in result.stdout, result.stdout


def test_promtool_accepts_the_alert_rules() -> None:
    result = promtool("check", "rules", str(ALERT_RULES))

    assert result.returncode == 0, result.stdout + result.stderr
