"""deploy/prometheus/alerts.yml is what ``manage.py write_alert_rules`` writes: a threshold changed in the site's
health checks or settings cannot leave Prometheus judging by the old one."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from django.test import override_settings

from crowdtrain.ops.alert_rules import render

from .promql import ALERT_RULES, alert_rules


def test_the_committed_rules_are_the_generated_ones() -> None:
    call_command("write_alert_rules", "--check")


def test_a_changed_threshold_shows_in_the_rules_and_fails_the_check(tmp_path: Path) -> None:
    copy = tmp_path / "alerts.yml"
    copy.write_text(ALERT_RULES.read_text())

    with override_settings(CROWDTRAIN_GONE_AFTER_S=30.0):
        written = render()
        with pytest.raises(CommandError, match="write_alert_rules"):
            call_command("write_alert_rules", "--check", "--out", str(copy))

    assert "crowdtrain_aggregator_heartbeat_age_seconds) > 30\n" in written


def test_every_rule_says_what_it_means() -> None:
    rules = alert_rules()

    assert {"CrowdtrainSiteAlert", "AggregatorSilent", "CampaignStalled", "TargetDown"} <= set(rules)
    assert all(rule["annotations"]["summary"] for rule in rules.values())
