"""deploy/prometheus/alerts.yml fires on the conditions crowdtrain.ops.health judges, checked by `promtool test rules`.

Each case is a made-up history of the metrics the site and the aggregators export
(series names, labels and values as /metrics writes them), and which alerts must be
firing at given times: promtool evaluates the real rules over it. The expected
annotations are the rules' own, with their labels filled in, so a template that
names a label the alert does not carry fails here.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

from .promql import ALERT_RULES, PROMTOOL, alert_rules, binary

RULES = alert_rules()
AGGREGATOR = 'aggregator="agg-1"'


def firing(alert: str, **labels: str) -> dict[str, Any]:
    """What promtool reports for ``alert`` firing with ``labels`` (the rule's own labels added)."""
    rule = RULES[alert]
    everything = {**labels, **{k: render(v, labels) for k, v in rule.get("labels", {}).items()}}
    return {
        "exp_labels": everything,
        "exp_annotations": {k: render(v, everything) for k, v in rule.get("annotations", {}).items()},
    }


def render(template: str, labels: dict[str, str]) -> str:
    """Fill in ``{{ $labels.x }}``, the only template the rules use; anything else fails the test."""
    text = re.sub(r"\{\{\s*\$labels\.(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)
    if "{{" in text:
        raise AssertionError(f"render() does not know this template: {template!r}")
    return text


def check(alert: str, at: str, *expected: dict[str, Any]) -> dict[str, Any]:
    return {"eval_time": at, "alertname": alert, "exp_alerts": list(expected)}


CASES: list[dict[str, Any]] = [
    {   # Its socket closes at 10 s: pending for the rule's 30 s, then firing.
        "interval": "5s",
        "input_series": [
            {"series": f"crowdtrain_aggregator_connected{{{AGGREGATOR}}}", "values": "1 1 0x20"},
            {"series": f"crowdtrain_aggregator_heartbeat_age_seconds{{{AGGREGATOR}}}", "values": "1 2 3x20"},
            {"series": f"crowdtrain_aggregator_running_slices{{{AGGREGATOR}}}", "values": "1x22"},
        ],
        "alert_rule_test": [
            check("AggregatorSilent", "35s"),
            check("AggregatorSilent", "45s", firing("AggregatorSilent", aggregator="agg-1")),
        ],
    },
    {   # Still connected, but its heartbeats stop: silent once the newest is 10 s old, for 30 s.
        "interval": "5s",
        "input_series": [
            {"series": f"crowdtrain_aggregator_connected{{{AGGREGATOR}}}", "values": "1x30"},
            {"series": f"crowdtrain_aggregator_heartbeat_age_seconds{{{AGGREGATOR}}}", "values": "1 1 0+5x28"},
            {"series": f"crowdtrain_aggregator_running_slices{{{AGGREGATOR}}}", "values": "1x30"},
        ],
        "alert_rule_test": [
            check("AggregatorSilent", "30s"),
            check("AggregatorSilent", "70s", firing("AggregatorSilent", aggregator="agg-1")),
        ],
    },
    {   # A token whose aggregator never started (or one holding slices only of ended campaigns) stalls nothing.
        "interval": "5s",
        "input_series": [
            {"series": 'crowdtrain_aggregator_connected{aggregator="spare"}', "values": "0x30"},
            {"series": 'crowdtrain_aggregator_running_slices{aggregator="spare"}', "values": "0x30"},
        ],
        "alert_rule_test": [check("AggregatorSilent", "2m")],
    },
    {   # Campaign 7 steps for 4 minutes, then stops: stalled 10 minutes after its last step, not before.
        # Campaign 8 was started 5 minutes ago and has no step yet: not stalled (yet). Campaign 9 has run
        # 20 minutes without a step: stalled. Campaign 10 is paused.
        "interval": "1m",
        "input_series": [
            {"series": 'crowdtrain_campaign_info{campaign="7",name="seven",state="running"}', "values": "1x30"},
            {"series": 'crowdtrain_campaign_committed_steps{campaign="7"}', "values": "0+1x4 4x26"},
            {"series": 'crowdtrain_campaign_info{campaign="8",name="eight",state="running"}',
             "values": "_x10 1x20"},
            {"series": 'crowdtrain_campaign_committed_steps{campaign="8"}', "values": "_x10 0x20"},
            {"series": 'crowdtrain_campaign_info{campaign="9",name="nine",state="running"}', "values": "1x30"},
            {"series": 'crowdtrain_campaign_committed_steps{campaign="9"}', "values": "0x30"},
            {"series": 'crowdtrain_campaign_info{campaign="10",name="ten",state="paused"}', "values": "1x30"},
            {"series": 'crowdtrain_campaign_committed_steps{campaign="10"}', "values": "3x30"},
        ],
        "alert_rule_test": [
            check("CampaignStalled", "13m", firing("CampaignStalled", campaign="9")),
            check("CampaignStalled", "15m", firing("CampaignStalled", campaign="7"),
                  firing("CampaignStalled", campaign="9")),
        ],
    },
    {   # Nobody has joined campaign 7 (the site's warning says so): no step, but not the critical stall.
        "interval": "1m",
        "input_series": [
            {"series": 'crowdtrain_campaign_info{campaign="7",name="seven",state="running"}', "values": "1x30"},
            {"series": 'crowdtrain_campaign_committed_steps{campaign="7"}', "values": "0x30"},
            {"series": 'crowdtrain_alert{code="campaign_waiting_for_volunteers",campaign="7",severity="warning"}',
             "values": "_x10 1x20"},
        ],
        "alert_rule_test": [
            check("CampaignStalled", "20m"),
            check("CrowdtrainSiteAlert", "20m", firing("CrowdtrainSiteAlert", code="campaign_waiting_for_volunteers",
                                                       campaign="7", severity="warning")),
        ],
    },
    {   # Stalled because its aggregator is silent: that alert says what to do, and the campaign's does not fire.
        "interval": "1m",
        "input_series": [
            {"series": 'crowdtrain_campaign_info{campaign="7",name="seven",state="running"}', "values": "1x30"},
            {"series": 'crowdtrain_campaign_committed_steps{campaign="7"}', "values": "5x30"},
            {"series": 'crowdtrain_alert{code="aggregator_silent",campaign="7",severity="critical"}',
             "values": "1x30"},
        ],
        "alert_rule_test": [
            check("CampaignStalled", "20m"),
            check("CrowdtrainSiteAlert", "20m",
                  firing("CrowdtrainSiteAlert", code="aggregator_silent", campaign="7", severity="critical")),
        ],
    },
    {   # Campaign 7 waits for its checkpoints (held: critical), 8 only has them behind (a warning): both
        # stopped stepping, and only 8's stall is the campaign's own alert.
        "interval": "1m",
        "input_series": [
            {"series": 'crowdtrain_campaign_info{campaign="7",name="seven",state="running"}', "values": "1x30"},
            {"series": 'crowdtrain_campaign_committed_steps{campaign="7"}', "values": "5x30"},
            {"series": 'crowdtrain_alert{code="campaign_checkpoints_behind",campaign="7",severity="critical"}',
             "values": "1x30"},
            {"series": 'crowdtrain_campaign_info{campaign="8",name="eight",state="running"}', "values": "1x30"},
            {"series": 'crowdtrain_campaign_committed_steps{campaign="8"}', "values": "5x30"},
            {"series": 'crowdtrain_alert{code="campaign_checkpoints_behind",campaign="8",severity="warning"}',
             "values": "1x30"},
        ],
        "alert_rule_test": [check("CampaignStalled", "20m", firing("CampaignStalled", campaign="8"))],
    },
    {   # An aggregator's checkpoints fail for a while, then the store takes them again; a repaired counter.
        "interval": "1m",
        "input_series": [
            {"series": 'crowdtrain_backbone_checkpoint_failures_total{instance="agg-1:8100",campaign="1",slice="0"}',
             "values": "0 0 1+2x5 11x30"},
            {"series": 'crowdtrain_step_counter_repairs_total{campaign="3",instance="s1"}', "values": "0 0 1x80"},
        ],
        "alert_rule_test": [
            check("CheckpointWritesFailing", "1m"),
            check("CheckpointWritesFailing", "5m", firing("CheckpointWritesFailing", instance="agg-1:8100")),
            check("CheckpointWritesFailing", "20m"),
            check("StepCounterRepaired", "30m", firing("StepCounterRepaired", campaign="3")),
            check("StepCounterRepaired", "70m"),  # an hour after the repair
        ],
    },
    {   # Two site processes count campaign 7's leases: 10 accepted and 30 expired in 10 minutes, summed.
        # Campaign 8 fails as often but has too few leases to judge; campaign 9 mostly succeeds.
        "interval": "1m",
        "input_series": [
            {"series": 'crowdtrain_lease_outcomes_total{campaign="7",state="accepted",reason="",instance="s1"}',
             "values": "0+1x20"},
            {"series": 'crowdtrain_lease_outcomes_total{campaign="7",state="expired",reason="deadline passed",'
                       'instance="s1"}', "values": "0+2x20"},
            {"series": 'crowdtrain_lease_outcomes_total{campaign="7",state="rejected",reason="stale version",'
                       'instance="s2"}', "values": "0+1x20"},
            {"series": 'crowdtrain_lease_outcomes_total{campaign="8",state="expired",reason="deadline passed",'
                       'instance="s1"}', "values": "0+1x20"},
            {"series": 'crowdtrain_lease_outcomes_total{campaign="9",state="accepted",reason="",instance="s1"}',
             "values": "0+5x20"},
            {"series": 'crowdtrain_lease_outcomes_total{campaign="9",state="expired",reason="deadline passed",'
                       'instance="s2"}', "values": "0+1x20"},
        ],
        "alert_rule_test": [check("LeaseFailuresSpike", "15m", firing("LeaseFailuresSpike", campaign="7"))],
    },
    {   # A Celery task failed at t=100 s: firing for 15 minutes after that, then not.
        "interval": "1m",
        "input_series": [
            {"series": 'crowdtrain_celery_task_last_failure_timestamp_seconds{task="expire_leases"}',
             "values": "100x30"},
        ],
        "alert_rule_test": [
            check("CeleryTaskFailing", "10m", firing("CeleryTaskFailing", task="expire_leases")),
            check("CeleryTaskFailing", "20m"),
        ],
    },
    {   # The site's own alerts, one rule for all: firing after a minute, with the site's severity.
        "interval": "30s",
        "input_series": [
            {"series": 'crowdtrain_alert{code="campaign_waiting_for_aggregators",campaign="7",severity="critical",'
                       'instance="s1"}', "values": "1x10"},
            {"series": 'crowdtrain_alert{code="lease_failures_spike",campaign="8",severity="warning",'
                       'instance="s1"}', "values": "0 1x9"},
        ],
        "alert_rule_test": [
            check("CrowdtrainSiteAlert", "30s"),
            check("CrowdtrainSiteAlert", "2m",
                  firing("CrowdtrainSiteAlert", code="campaign_waiting_for_aggregators", campaign="7",
                         severity="critical"),
                  firing("CrowdtrainSiteAlert", code="lease_failures_spike", campaign="8", severity="warning")),
            check("CampaignWaitingForAggregators", "2m",
                  firing("CampaignWaitingForAggregators", campaign="7")),
        ],
    },
    {   # A site process stops answering /metrics.
        "interval": "30s",
        "input_series": [{"series": 'up{job="crowdtrain-site",instance="site-1:8000"}', "values": "1 0x6"}],
        "alert_rule_test": [
            check("TargetDown", "1m"),
            check("TargetDown", "2m", firing("TargetDown", job="crowdtrain-site", instance="site-1:8000")),
        ],
    },
]  # fmt: skip


def test_every_alert_has_a_case() -> None:
    tested = {check["alertname"] for case in CASES for check in case["alert_rule_test"] if check["exp_alerts"]}

    assert tested == set(RULES), f"alerts without a firing case: {sorted(set(RULES) - tested)}"


def test_promtool_finds_every_alert_firing_when_and_only_when_the_site_would(tmp_path: Path) -> None:
    # JSON is YAML; the rules are read where they are, so the cases test deploy/'s file itself.
    tests = tmp_path / "alerts_test.yml"
    tests.write_text(json.dumps({"rule_files": [str(ALERT_RULES)], "evaluation_interval": "5s", "tests": CASES}))

    result = subprocess.run([binary(PROMTOOL), "test", "rules", str(tests)], capture_output=True, text=True,
                            timeout=60)  # fmt: skip

    assert result.returncode == 0, result.stdout + result.stderr
